"""Rotary embeddings against transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb (fp32, atol 1e-5).

Each case runs with the cpu backend's native kernel and with its torch path.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.context import building
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from tests.layers.conftest import make_context

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
ATOL = 1e-5

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.fixture
def context(cpu_backend) -> BuildContext:
    return make_context(cpu_backend, max_model_len=256)


def build_rope(context: BuildContext, config: dict, head_dim: int = HEAD_DIM, **kwargs: int) -> RotaryEmbedding:
    with building(context):
        return get_rope(config, head_dim, **kwargs)


def rotate(rope: RotaryEmbedding, batch: ForwardBatch, query: torch.Tensor,
           key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our rope on copies: forward may rotate its inputs in place."""
    return rope(batch, query.clone(), key.clone())


def make_batch(seq_lens: list[int], query_lens: list[int]) -> ForwardBatch:
    """A batch whose sequence i computes its last ``query_lens[i]`` of ``seq_lens[i]`` positions."""
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)])
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    num_tokens = int(starts[-1])
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64), positions=positions,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64), query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens), block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.int64),
        logits_indices=starts[1:] - 1, query_lens=list(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_size=16)


def hf_rotate(config: dict, query: torch.Tensor, key: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rope of flat ``[tokens, heads, dim]`` tensors, all tokens in one forward."""
    hf_config = LlamaConfig(hidden_size=HEADS * query.shape[-1], num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, head_dim=query.shape[-1], **config)
    rope = LlamaRotaryEmbedding(hf_config)
    q, k = query.transpose(0, 1)[None], key.transpose(0, 1)[None]  # [1, heads, tokens, dim]
    cos, sin = rope(q, positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


def random_qk(num_tokens: int, head_dim: int = HEAD_DIM, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, HEADS, head_dim, generator=generator),
            torch.randn(num_tokens, KV_HEADS, head_dim, generator=generator))


# Each case: the config as real hub checkpoints write it (rope_theta + rope_scaling) and as transformers 5
# writes it (rope_parameters holding rope_theta).
CONFIGS = {
    "default-legacy": {"max_position_embeddings": 128, "rope_theta": 10000.0},
    "default-v5": {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default",
                                                                        "rope_theta": 10000.0}},
    "linear-legacy": {"max_position_embeddings": 128, "rope_theta": 50000.0,
                      "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "linear-legacy-type-key": {"max_position_embeddings": 128, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "linear-v5": {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 50000.0}},
    "llama3-legacy": {"max_position_embeddings": 512, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING},
    "llama3-v5": {"max_position_embeddings": 512,
                  "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0}},
}

# A mixed step: a fresh prefill, two decodes, and a chunk continuing after 40 cached tokens.
SEQ_LENS, QUERY_LENS = [9, 1, 120, 48], [9, 1, 1, 8]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers(context: BuildContext, name: str) -> None:
    config = CONFIGS[name]
    batch = make_batch(SEQ_LENS, QUERY_LENS)
    query, key = random_qk(batch.num_tokens)
    ours_q, ours_k = rotate(build_rope(context, config), batch, query, key)
    theirs_q, theirs_k = hf_rotate(config, query, key, batch.positions)
    assert ours_q.shape == query.shape and ours_k.shape == key.shape
    torch.testing.assert_close(ours_q, theirs_q, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_k, theirs_k, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["linear-legacy", "llama3-legacy"])
def test_scaled_cases_differ_from_default(name: str) -> None:
    """Guards the cases above against being vacuous: scaling changes the rotation at these positions."""
    batch = make_batch(SEQ_LENS, QUERY_LENS)
    query, key = random_qk(batch.num_tokens)
    config = CONFIGS[name]
    scaled, _ = hf_rotate(config, query, key, batch.positions)
    default, _ = hf_rotate({k: v for k, v in config.items() if k != "rope_scaling"}, query, key, batch.positions)
    assert (scaled - default).abs().max() > 0.1


def test_dynamic_beyond_max_position_matches_one_transformers_forward(context: BuildContext) -> None:
    """Dynamic NTK: each sequence's base grows with its own length, as transformers does for one forward."""
    config = {"max_position_embeddings": 32, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    # A prefill of 50 tokens (> 32), a decode at position 70, a short prefill inside the original range.
    seq_lens, query_lens = [50, 71, 12], [50, 1, 12]
    batch = make_batch(seq_lens, query_lens)
    query, key = random_qk(batch.num_tokens, seed=1)
    ours_q, ours_k = rotate(build_rope(context, config, max_position=256), batch, query, key)
    start = 0
    for seq_len, query_len in zip(seq_lens, query_lens, strict=True):
        rows = slice(start, start + query_len)
        # transformers sees the whole sequence at once; compare the rows this step computed.
        full_q, full_k = random_qk(seq_len, seed=2)
        full_q[-query_len:], full_k[-query_len:] = query[rows], key[rows]
        theirs_q, theirs_k = hf_rotate(config, full_q, full_k, torch.arange(seq_len))
        torch.testing.assert_close(ours_q[rows], theirs_q[-query_len:], atol=ATOL, rtol=0)
        torch.testing.assert_close(ours_k[rows], theirs_k[-query_len:], atol=ATOL, rtol=0)
        start += query_len
    static_q, _ = hf_rotate({"max_position_embeddings": 32}, query[:50], key[:50], torch.arange(50))
    assert (static_q - ours_q[:50]).abs().max() > 0.1  # the long sequence really was rescaled


def test_dynamic_frequencies_stay_on_the_batch_device(context: BuildContext) -> None:
    """Dynamic NTK's per-token bases come from the batch's tensors on their device: no tensor made from a host
    list (on a GPU that raised a device mismatch, and a pageable copy is refused inside a CUDA graph's capture).
    The meta device stands in for the GPU: a CPU tensor meeting a meta one raises the same way."""
    config = {"max_position_embeddings": 32, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    rope = build_rope(context, config, max_position=256)
    batch = make_batch([50, 71, 12], [50, 1, 12])
    expected = rope._dynamic_freqs(batch)
    for name in ("positions", "seq_lens", "query_start_loc", "input_ids", "slot_mapping", "block_tables"):
        setattr(batch, name, getattr(batch, name).to("meta"))
    on_meta = rope._dynamic_freqs(batch)
    assert on_meta.device.type == "meta" and on_meta.shape == expected.shape


@pytest.mark.parametrize("config", [CONFIGS["default-legacy"], CONFIGS["llama3-v5"]], ids=["default", "llama3"])
def test_partial_rotary_rotates_only_the_first_rotary_dim_features(context: BuildContext, config: dict) -> None:
    rotary_dim, head_dim = 16, 40
    batch = make_batch(SEQ_LENS, QUERY_LENS)
    query, key = random_qk(batch.num_tokens, head_dim=head_dim, seed=3)
    ours_q, ours_k = rotate(build_rope(context, config, head_dim, rotary_dim=rotary_dim), batch, query, key)
    # Dense reference: transformers' rope of a rotary_dim-wide head on the first features, the rest untouched.
    theirs_q, theirs_k = hf_rotate(config, query[..., :rotary_dim], key[..., :rotary_dim], batch.positions)
    torch.testing.assert_close(ours_q[..., :rotary_dim], theirs_q, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_k[..., :rotary_dim], theirs_k, atol=ATOL, rtol=0)
    assert torch.equal(ours_q[..., rotary_dim:], query[..., rotary_dim:])
    assert torch.equal(ours_k[..., rotary_dim:], key[..., rotary_dim:])


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 16])
def test_query_and_key_as_views_of_one_fused_qkv_output(context: BuildContext, rotary_dim: int) -> None:
    """As attention layers call it: q and k split from the qkv projection, rows strided; v stays untouched."""
    config = CONFIGS["llama3-legacy"]
    batch = make_batch(SEQ_LENS, QUERY_LENS)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(batch.num_tokens, q_size + 2 * kv_size, generator=torch.Generator().manual_seed(4))
    original = qkv.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    query, key = q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM)
    ours_q, ours_k = build_rope(context, config, rotary_dim=rotary_dim)(batch, query, key)
    q0, k0 = original[:, :q_size].view(-1, HEADS, HEAD_DIM), original[:, q_size:q_size + kv_size].view(
        -1, KV_HEADS, HEAD_DIM)
    theirs_q, theirs_k = hf_rotate(config, q0[..., :rotary_dim], k0[..., :rotary_dim], batch.positions)
    torch.testing.assert_close(ours_q[..., :rotary_dim], theirs_q, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_k[..., :rotary_dim], theirs_k, atol=ATOL, rtol=0)
    assert torch.equal(ours_q[..., rotary_dim:], q0[..., rotary_dim:])
    assert torch.equal(ours_k[..., rotary_dim:], k0[..., rotary_dim:])
    assert torch.equal(v, original[:, q_size + kv_size:]), "the value columns of the fused buffer are not written"


@pytest.mark.parametrize("config", [
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    {"rope_scaling": {"type": "yarn", "factor": 4.0}},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
], ids=["rope_scaling", "legacy-type-key", "rope_parameters"])
def test_unknown_rope_type_is_an_error_naming_the_field(config: dict) -> None:
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type.*'yarn'"):
        get_rope({"max_position_embeddings": 64, **config}, HEAD_DIM)
