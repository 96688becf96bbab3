"""GPT-J style (interleaved pairs) rope, partial, against transformers' GLM-4 apply_rotary_pos_emb.

The native kernel does only the neox layout, so this style must take the torch path on both backends.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4Config
from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding, apply_rotary_pos_emb

from pluginfer.backends.cpu.backend import CpuBackend
from pluginfer.layers.context import building
from pluginfer.layers.rotary import get_rope, partial_rotary_dim
from tests.layers.conftest import make_context
from tests.layers.test_rotary import HEADS, KV_HEADS, QUERY_LENS, SEQ_LENS, make_batch, random_qk

HEAD_DIM = 32


def hf_glm4_rotate(config: dict, query: torch.Tensor, key: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hf_config = Glm4Config(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                           head_dim=HEAD_DIM, **config)
    q, k = query.transpose(0, 1)[None], key.transpose(0, 1)[None]  # [1, heads, tokens, dim]
    cos, sin = Glm4RotaryEmbedding(hf_config)(q, positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


@pytest.mark.parametrize("factor", [0.5, 1.0], ids=["half-rotary", "full-rotary"])
def test_interleaved_matches_transformers_glm4(cpu_backend: CpuBackend, factor: float) -> None:
    config = {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": factor}}
    rotary_dim = partial_rotary_dim(config, HEAD_DIM)
    assert rotary_dim == int(HEAD_DIM * factor)
    with building(make_context(cpu_backend, max_model_len=256)):
        rope = get_rope(config, HEAD_DIM, rotary_dim=rotary_dim, is_neox_style=False)
    assert rope.kernel is None
    batch = make_batch(SEQ_LENS, QUERY_LENS)
    query, key = random_qk(batch.num_tokens, head_dim=HEAD_DIM, seed=5)
    ours_q, ours_k = rope(batch, query.clone(), key.clone())
    theirs_q, theirs_k = hf_glm4_rotate(config, query, key, batch.positions)
    torch.testing.assert_close(ours_q, theirs_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_k, theirs_k, atol=1e-5, rtol=0)
    with building(make_context(cpu_backend, max_model_len=256)):
        neox_q, _ = get_rope(config, HEAD_DIM, rotary_dim=rotary_dim)(batch, query.clone(), key.clone())
    assert (neox_q - theirs_q).abs().max() > 0.1  # the layouts really differ at these positions


@pytest.mark.parametrize("config", [{"partial_rotary_factor": 0.25},
                                    {"rope_parameters": {"partial_rotary_factor": 0.25}}, {}],
                         ids=["top-level", "rope_parameters", "default"])
def test_partial_rotary_dim_reads_either_config_style(config: dict) -> None:
    assert partial_rotary_dim(config, 64, default_factor=0.5) == (32 if not config else 16)


@pytest.mark.parametrize("factor", [0.0, 1.5, "half", 0.3],
                         ids=["zero", "above-one", "not-a-number", "odd-dim"])
def test_bad_partial_rotary_factor_is_an_error_naming_the_field(factor: object) -> None:
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        partial_rotary_dim({"partial_rotary_factor": factor}, 10)  # 10 * 0.3: an odd rotary dimension
