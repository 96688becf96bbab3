"""Multi-head latent attention under tensor parallelism: heads split over 2 and 4 thread ranks, against 1 rank.

Each rank builds the layer, loads the same full weights (its heads' slices of ``q_proj`` / ``q_b_proj``,
``kv_b_proj`` and ``o_proj``; ``q_a_proj`` and ``kv_a_proj_with_mqa`` whole), allocates its own latent cache
and runs a paged batch: a prefill that continues cached prefixes (chunked), then a decode step. Outputs must
equal the single-rank layer's within the float32 bound of tests/layers/test_moe_tp.py (1e-5 of the largest
magnitude; only the order of sums differs), and every rank's latent cache must equal the single rank's: the
cache holds one latent "head" shared by all query heads, so each rank keeps all of it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pluginfer.core.protocols import KVCacheSpec
from pluginfer.layers.mla import MultiHeadLatentAttention
from pluginfer.layers.rotary import RotaryEmbedding
from pluginfer.layers.weights import load_named_weights
from tests.backends.paged import paged_batch
from tests.layers.test_moe_tp import (
    Holder,
    Rank,
    assert_tp_matches,
    build_on,
    on_ranks,
    one_torch_thread,
    rank_context,
)

HIDDEN, HEADS, KV_LORA, NOPE, ROPE, V_DIM, Q_LORA = 64, 8, 32, 16, 8, 16, 24
BLOCK_SIZE, NUM_BLOCKS = 4, 16
# Step 1: sequence 0 starts (7 tokens), sequence 1 continues after 6 cached tokens (5 more), sequence 2 a
# single token after 3 cached. Step 2: one decode token each.
STEPS = (([7, 11, 4], [7, 5, 1]), ([8, 12, 5], [1, 1, 1]))

__all__ = ["one_torch_thread"]  # the fixture, autouse here too


def mla_weights(q_lora: int | None, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    qk = HEADS * (NOPE + ROPE)
    weights = {"attn.kv_a_proj_with_mqa.weight": randn(KV_LORA + ROPE, HIDDEN),
               "attn.kv_a_layernorm.weight": 1 + randn(KV_LORA, scale=0.1),
               "attn.kv_b_proj.weight": randn(HEADS * (NOPE + V_DIM), KV_LORA),
               "attn.o_proj.weight": randn(HIDDEN, HEADS * V_DIM)}
    if q_lora is None:
        weights["attn.q_proj.weight"] = randn(qk, HIDDEN)
    else:
        weights |= {"attn.q_a_proj.weight": randn(q_lora, HIDDEN), "attn.q_a_layernorm.weight": 1 + randn(q_lora),
                    "attn.q_b_proj.weight": randn(qk, q_lora)}
    return weights


def run_mla(collective: object, q_lora: int | None, hidden: list[torch.Tensor],
            tables: list[list[int]], prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs of both steps, the latent cache afterwards) on one rank."""
    ctx = rank_context(collective)

    def make() -> nn.Module:
        rope = RotaryEmbedding(ROPE, ROPE, 64, 10000.0, is_neox_style=False)
        return Holder(attn=MultiHeadLatentAttention(HIDDEN, HEADS, q_lora, KV_LORA, NOPE, ROPE, V_DIM, rope,
                                                    scale=(NOPE + ROPE) ** -0.5))

    model = build_on(ctx, make)
    load_named_weights(model, mla_weights(q_lora).items(), stacked=())
    attn = model.attn
    assert attn.num_heads == HEADS // collective.world_size
    spec = KVCacheSpec(1, attn.num_kv_heads, attn.head_dim, value_in_key=attn.kv_lora_rank)
    assert spec == KVCacheSpec(1, 1, KV_LORA + ROPE, value_in_key=KV_LORA), "the full latent on every rank"
    (key_cache, value_cache), = ctx.backend.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, ctx.dtype)
    key_cache.copy_(prefix)  # the cached prefixes (and garbage elsewhere), the same on every rank
    attn.attn.kv_cache = (key_cache, value_cache)
    outputs = []
    for (seq_lens, query_lens), x in zip(STEPS, hidden, strict=True):
        batch = paged_batch(ctx.backend, tables, seq_lens, query_lens, BLOCK_SIZE)
        with torch.inference_mode():
            outputs.append(attn(batch, x))
    return torch.cat(outputs), key_cache.clone()


@pytest.mark.parametrize("q_lora", [Q_LORA, None], ids=["q-lora", "plain-q-proj"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_latent_attention_on_ranks_equals_one_rank(q_lora: int | None, world_size: int) -> None:
    generator = torch.Generator().manual_seed(1)
    hidden = [torch.randn(sum(query_lens), HIDDEN, generator=generator) for _, query_lens in STEPS]
    prefix = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 1, KV_LORA + ROPE, generator=generator)
    tables = [[3, 9], [0, 5, 12], [7, 2]]
    reference, reference_cache = on_ranks(1, lambda c: run_mla(c, q_lora, hidden, tables, prefix))[0]
    results = on_ranks(world_size, lambda c: run_mla(c, q_lora, hidden, tables, prefix))
    assert reference.shape == (hidden[0].shape[0] + hidden[1].shape[0], HIDDEN)
    assert_tp_matches([out for out, _ in results], reference)
    for _, cache in results:  # same latent written on every rank; within rounding of the single rank's
        assert torch.equal(cache, results[0][1])
        torch.testing.assert_close(cache, reference_cache, rtol=1e-5, atol=1e-5)


def test_heads_that_do_not_split_are_an_error() -> None:
    ctx = rank_context(Rank(0, 3))
    with pytest.raises(ValueError, match="num_attention_heads 8 is not divisible by the tensor-parallel size 3"):
        build_on(ctx, lambda: MultiHeadLatentAttention(HIDDEN, HEADS, None, KV_LORA, NOPE, ROPE, V_DIM,
                                                       RotaryEmbedding(ROPE, ROPE, 64, 10000.0), 1.0))
