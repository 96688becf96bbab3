"""The native prefill attention (``layer_ops.paged_prefill_attention``, csrc/prefill_attention.c) against a float64
gather-and-softmax reference, and its promise that a row's bits depend only on its own position and keys: not on
its batch, its chunk of the prompt or its tile. The engine-level paths (``CpuBackend.paged_attention``) are in
test_cpu_attention.py."""

from __future__ import annotations

import pytest
import torch

from pluginfer.backends.cpu import layer_ops
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native


@pytest.fixture(autouse=True)
def prefill_kernel() -> None:
    reason = native.available()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")
    if not native_library.load().prefill_attention_supported():
        pytest.skip("prefill_attention.c is built for AVX-512 only; this CPU takes SDPA")


def paged(seq_lens: list[int], kv_heads: int, head_dim: int, v_dim: int, dtype: torch.dtype, block_size: int = 16,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches with every sequence's blocks scattered, and large garbage in the slots no sequence owns."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    keys = 30 * torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    values = 30 * torch.randn(num_blocks, block_size, kv_heads, v_dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
    used = 0
    for s, n in enumerate(seq_lens):
        tables[s, :blocks[s]] = order[used:used + blocks[s]]
        rows = torch.arange(n)
        slots = (tables[s, rows // block_size], rows % block_size)
        keys[slots] = torch.randn(n, kv_heads, head_dim, generator=generator)
        values[slots] = torch.randn(n, kv_heads, v_dim, generator=generator)
        used += blocks[s]
    return keys.to(dtype), values.to(dtype), tables


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
              starts: list[int], seq_lens: list[int], scale: float, window: int | None,
              soft_cap: float | None = None) -> torch.Tensor:
    block_size, heads = keys.shape[1], query.shape[1]
    out = []
    for s, length in enumerate(seq_lens):
        rows = torch.arange(length)
        k = keys[tables[s, rows // block_size], rows % block_size].double()
        v = values[tables[s, rows // block_size], rows % block_size].double()
        k, v = (t.repeat_interleave(heads // keys.shape[2], 1) for t in (k, v))
        q = query[starts[s]:starts[s + 1]].double()
        positions = torch.arange(length - q.shape[0], length)[:, None]
        allowed = rows[None, :] <= positions
        if window is not None:
            allowed &= rows[None, :] > positions - window
        scores = torch.einsum("qhd,khd->hqk", q, k).mul(scale)
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(out)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, starts: list[int],
           seq_lens: list[int], scale: float, window: int | None, soft_cap: float | None = None) -> torch.Tensor:
    out = layer_ops.paged_prefill_attention(query, keys, values, tables, torch.tensor(starts),
                                            torch.tensor(seq_lens), scale, window, soft_cap)
    assert out is not None and out.dtype == torch.float32
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "v_dim", "window", "dtype", "soft_cap"), [
    (16, 8, 64, 64, None, torch.float32, None),
    (14, 2, 64, 64, None, torch.float16, None),  # 7 query heads a KV head: tiles of 48 rows cut across tokens
    (8, 8, 128, 128, 37, torch.bfloat16, None),
    (4, 1, 32, 80, 16, torch.float32, None),  # a value dim that is not a whole number of 4-register chunks
    (6, 2, 16, 16, 200, torch.float32, None),
    (8, 4, 64, 64, 40, torch.float32, 2.0),  # Gemma 2's soft cap, low enough to bend most scores
])
def test_matches_the_float64_reference(heads: int, kv_heads: int, head_dim: int, v_dim: int, window: int | None,
                                       dtype: torch.dtype, soft_cap: float | None) -> None:
    """Whole prompts, prompts after cached tokens (a prefix-cache hit, a later chunk), one-token rows, lengths around
    the 16-key columns and the 48-row tiles."""
    seq_lens, query_lens = [1, 17, 150, 64, 97], [1, 17, 61, 16, 3]
    keys, values, tables = paged(seq_lens, kv_heads, head_dim, v_dim, dtype)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    query = 2 * torch.randn(starts[-1], heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim ** -0.5
    out = attend(query, keys, values, tables, starts, seq_lens, scale, window, soft_cap)
    # the cache's 16-bit values widen exactly: the reference reads the same values
    expected = reference(query, keys, values, tables, starts, seq_lens, scale, window, soft_cap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 50])
def test_a_row_does_not_depend_on_its_batch_or_chunk(window: int | None) -> None:
    """A prompt prefilled at once, in chunks (each chunk's keys already cached before it) or beside another prompt:
    the same bits for every row, as a prefix-cache hit must give the same text as a miss."""
    keys, values, tables = paged([300, 90], 2, 64, 64, torch.float32, seed=4)
    query = torch.randn(390, 14, 64, generator=torch.Generator().manual_seed(5))
    whole = attend(query[:300], keys, values, tables[:1], [0, 300], [300], 0.125, window)
    together = attend(query, keys, values, tables, [0, 300, 390], [300, 90], 0.125, window)
    assert torch.equal(together[:300], whole)
    chunks = [attend(query[a:b], keys, values, tables[:1], [0, b - a], [b], 0.125, window)
              for a, b in ((0, 7), (7, 160), (160, 161), (161, 300))]
    assert torch.equal(torch.cat(chunks), whole)


def test_a_16_bit_query_is_widened_exactly() -> None:
    """A bfloat16 model's prefill: its query widened to float32 gives the float32 query's very bits."""
    keys, values, tables = paged([70], 2, 64, 64, torch.bfloat16)
    query = torch.randn(70, 4, 64).bfloat16()
    got = attend(query, keys, values, tables, [0, 70], [70], 0.125, None)
    assert torch.equal(got, attend(query.float(), keys, values, tables, [0, 70], [70], 0.125, None))


@pytest.mark.parametrize("case", ["head dim 40", "float64 query", "mixed caches"])
def test_what_it_does_not_take_goes_to_the_torch_path(case: str) -> None:
    keys, values, tables = paged([20], 2, 64 if case != "head dim 40" else 40, 64, torch.float32)
    query = torch.randn(20, 4, keys.shape[-1])
    if case == "float64 query":
        query = query.double()
    if case == "mixed caches":
        values = values.half()
    assert layer_ops.paged_prefill_attention(query, keys, values, tables, torch.tensor([0, 20]), torch.tensor([20]),
                                             0.125, None, None) is None
