"""Phi-3's LongRoPE against transformers' Phi3RotaryEmbedding + apply_rotary_pos_emb (fp32, atol 1e-5).

transformers picks the short or long factors per forward by the sequence's length; ours picks once from
max_model_len (see LongRopeEmbedding). Each case compares a forward on the side the run chose.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from pluginfer.core.protocols import BuildContext
from pluginfer.layers.context import building
from pluginfer.layers.rotary import LongRopeEmbedding
from tests.layers.conftest import make_context
from tests.layers.test_rotary import make_batch, random_qk

HEADS, KV_HEADS, HEAD_DIM, ROTARY_DIM = 4, 2, 32, 24  # partial_rotary_factor 0.75
ORIGINAL, MAX_POSITIONS = 64, 256
SHORT = [1.0 + 0.1 * i for i in range(ROTARY_DIM // 2)]
LONG = [1.5 + 0.7 * i for i in range(ROTARY_DIM // 2)]


def scaling(**extra: float) -> dict:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG, **extra}


def build(context: BuildContext, max_model_len: int, rope_scaling: dict) -> LongRopeEmbedding:
    with building(context):
        return LongRopeEmbedding(HEAD_DIM, ROTARY_DIM, MAX_POSITIONS, 10000.0, rope_scaling,
                                 original_max_position=ORIGINAL, max_position_embeddings=MAX_POSITIONS,
                                 max_model_len=max_model_len)


def hf_rotate(rope_scaling: dict, query: torch.Tensor, key: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rope of flat ``[tokens, heads, dim]`` tensors in one forward over ``positions``."""
    config = Phi3Config(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                        max_position_embeddings=MAX_POSITIONS, original_max_position_embeddings=ORIGINAL,
                        rope_parameters={**rope_scaling, "partial_rotary_factor": ROTARY_DIM / HEAD_DIM})
    rope = Phi3RotaryEmbedding(config)
    q, k = query.transpose(0, 1)[None], key.transpose(0, 1)[None]
    cos, sin = rope(q, positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


@pytest.fixture
def context(cpu_backend) -> BuildContext:
    return make_context(cpu_backend, max_model_len=MAX_POSITIONS)


# (max_model_len, sequence length): a run that fits the original length (short factors) and one that
# outgrows it (long factors), each against transformers on a sequence on the same side.
SIDES = {"short": (ORIGINAL, 40), "long": (MAX_POSITIONS, 200)}
SCALINGS = {"default-scale": scaling(), "factor": scaling(factor=8.0), "attention-factor": scaling(attention_factor=1.3)}


@pytest.mark.parametrize("scaling_name", list(SCALINGS))
@pytest.mark.parametrize("side", list(SIDES))
def test_matches_transformers(context: BuildContext, side: str, scaling_name: str) -> None:
    max_model_len, seq_len = SIDES[side]
    rope = build(context, max_model_len, SCALINGS[scaling_name])
    assert rope.use_long_factors == (side == "long")
    # One prefill of the whole sequence, then the same sequence's last 3 tokens as a continuing chunk.
    for query_len in (seq_len, 3):
        batch = make_batch([seq_len], [query_len])
        query, key = random_qk(seq_len, head_dim=HEAD_DIM, seed=query_len)
        theirs_q, theirs_k = hf_rotate(SCALINGS[scaling_name], query, key, torch.arange(seq_len))
        ours_q, ours_k = rope(batch, query[-query_len:].clone(), key[-query_len:].clone())
        torch.testing.assert_close(ours_q, theirs_q[-query_len:], atol=1e-5, rtol=0)
        torch.testing.assert_close(ours_k, theirs_k[-query_len:], atol=1e-5, rtol=0)
        assert torch.equal(ours_q[..., ROTARY_DIM:], query[-query_len:, :, ROTARY_DIM:])


def test_long_and_short_factors_really_differ(context: BuildContext) -> None:
    """Guards the cases above against being vacuous: the two runs rotate the same tokens differently."""
    batch = make_batch([40], [40])
    query, key = random_qk(40, head_dim=HEAD_DIM)
    short_q, _ = build(context, ORIGINAL, scaling())(batch, query.clone(), key.clone())
    long_q, _ = build(context, MAX_POSITIONS, scaling())(make_batch([40], [40]), query.clone(), key.clone())
    assert (long_q - short_q).abs().max() > 0.1


@pytest.mark.parametrize("field", ["short_factor", "long_factor"])
def test_factor_list_of_the_wrong_length_is_an_error_naming_it(context: BuildContext, field: str) -> None:
    bad = scaling(**{field: [1.0] * (ROTARY_DIM // 2 + 1)})
    with pytest.raises(ValueError, match=rf"rope_scaling\.{field}.*12 numbers"):
        build(context, MAX_POSITIONS, bad)
