"""CpuBackend.paged_attention over a latent cache (KVCacheSpec.value_in_key): one KV head whose value is
the key's last features, written through ``value=None``; against dense float64 attention per sequence. A
quantized latent cache's value view is itself a quantized cache: the latent's codes and the row's scale."""

from __future__ import annotations

import pytest
import torch

from pluginfer.backends.cpu.backend import CpuBackend
from pluginfer.core.protocols import KVCacheSpec
from pluginfer.layers import kv_quant
from tests.backends import test_cpu_attention as dense
from tests.backends.paged import paged_batch
from tests.backends.test_cpu_attention import (
    BF16_TOLERANCE,
    BLOCK_SIZE,
    CASES,
    FP32_TOLERANCE,
    HEAD_DIM,
    HEADS,
    NUM_BLOCKS,
    SCALE,
    Step,
    reference,
)

# The same fixtures: every case runs with the native kernels loaded and on the torch path.
backend, one_torch_thread = dense.backend, dense.one_torch_thread

LATENT = 12  # the value: the last 12 of the key's 16 features


def build_latent_step(backend: CpuBackend, seq_lens: list[int], query_lens: list[int],
                      dtype: torch.dtype = torch.float32, seed: int = 0) -> Step:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(dtype)

    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM, value_in_key=LATENT)
    key_cache, value_cache = backend.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, dtype)[0]
    assert value_cache.data_ptr() == key_cache[..., HEAD_DIM - LATENT:].data_ptr() and value_cache.shape[-1] == LATENT
    key_cache.copy_(randn(*key_cache.shape, scale=30.0))  # garbage in slots nobody owns
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    flat_keys = key_cache.view(-1, 1, HEAD_DIM)
    tables, all_keys = [], []
    for seq_len, query_len in zip(seq_lens, query_lens, strict=True):
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        tables.append(blocks)
        keys = randn(seq_len, 1, HEAD_DIM)
        cached = torch.arange(seq_len - query_len)
        flat_keys[torch.tensor(blocks)[cached // BLOCK_SIZE] * BLOCK_SIZE + cached % BLOCK_SIZE] = keys[:len(cached)]
        all_keys.append(keys)
    batch = paged_batch(backend, tables, seq_lens, query_lens, BLOCK_SIZE)
    new_keys = torch.cat([k[s - q:] for k, s, q in zip(all_keys, seq_lens, query_lens, strict=True)])
    query = randn(len(batch.positions), HEADS, HEAD_DIM)
    return Step(batch, query, new_keys, None, (key_cache, value_cache), all_keys,
                [keys[..., -LATENT:] for keys in all_keys])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_latent_cache_matches_dense_reference(backend: CpuBackend, case: str, sliding_window: int | None) -> None:
    step = build_latent_step(backend, *CASES[case])
    out = backend.paged_attention(step.query, step.key, None, step.cache, step.batch, SCALE,
                                  sliding_window=sliding_window)
    assert out.shape == (step.batch.num_tokens, HEADS, LATENT)
    torch.testing.assert_close(out.double(), reference(step, sliding_window), **FP32_TOLERANCE)
    key_cache = step.cache[0].view(-1, 1, HEAD_DIM)
    assert torch.equal(key_cache[step.batch.slot_mapping], step.key), "this step's keys are written"


def test_latent_cache_in_bfloat16(backend: CpuBackend) -> None:
    step = build_latent_step(backend, *CASES["mixed"], dtype=torch.bfloat16, seed=1)
    out = backend.paged_attention(step.query, step.key, None, step.cache, step.batch, SCALE)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(step), **BF16_TOLERANCE)


def test_block_copies_move_the_latent_once(backend: CpuBackend) -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=HEAD_DIM, value_in_key=LATENT)
    caches = backend.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    for key, _ in caches:
        key.copy_(torch.randn(key.shape))
    backend.copy_blocks(caches, [(3, 7), (5, 9)])
    for key, value in caches:
        assert torch.equal(key[7], key[3]) and torch.equal(key[9], key[5])
        assert torch.equal(value[7], key[3][..., -LATENT:])


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_latent_cache(backend: CpuBackend, case: str, cache_dtype: torch.dtype) -> None:
    """The key row [rope | latent | scale] quantized once; the value view [latent | scale] reads the same scale.
    Against the dense reference over the dequantized rows, natively and on the torch path."""
    seq_lens, query_lens = CASES[case]
    generator = torch.Generator().manual_seed(2)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM, value_in_key=LATENT)
    key_cache, value_cache = backend.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, cache_dtype)[0]
    assert value_cache.shape[-1] == LATENT + kv_quant.SCALE_BYTES and kv_quant.feature_dim(value_cache) == LATENT
    # garbage in slots nobody owns, finite: the torch path reads padding slots and weighs them by zero
    slots = torch.arange(NUM_BLOCKS * BLOCK_SIZE)
    kv_quant.write_rows(key_cache, slots, 30.0 * torch.randn(len(slots), 1, HEAD_DIM, generator=generator))
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables, all_keys = [], []
    for seq_len, query_len in zip(seq_lens, query_lens, strict=True):
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        tables.append(blocks)
        keys = torch.randn(seq_len, 1, HEAD_DIM, generator=generator)
        cached = torch.arange(seq_len - query_len)
        kv_quant.write_rows(key_cache, torch.tensor(blocks)[cached // BLOCK_SIZE] * BLOCK_SIZE + cached % BLOCK_SIZE,
                            keys[:len(cached)])
        all_keys.append(keys)
    batch = paged_batch(backend, tables, seq_lens, query_lens, BLOCK_SIZE)
    new_keys = torch.cat([k[s - q:] for k, s, q in zip(all_keys, seq_lens, query_lens, strict=True)])
    query = torch.randn(len(batch.positions), HEADS, HEAD_DIM, generator=generator)
    stored = [kv_quant.dequantize(kv_quant.quantize(keys, cache_dtype)) for keys in all_keys]
    step = Step(batch, query, new_keys, None, (key_cache, value_cache), stored, [k[..., -LATENT:] for k in stored])
    out = backend.paged_attention(query, new_keys, None, step.cache, batch, SCALE)
    assert out.shape == (batch.num_tokens, HEADS, LATENT)
    torch.testing.assert_close(out.double(), reference(step), **FP32_TOLERANCE)
    written = kv_quant.dequantize(key_cache.view(-1, 1, HEAD_DIM + kv_quant.SCALE_BYTES)[batch.slot_mapping])
    assert torch.equal(written, kv_quant.dequantize(kv_quant.quantize(new_keys, cache_dtype)))
