"""CpuBackend.paged_attention on a hand-built paged cache against dense float64 attention per sequence.

Every case runs twice: with the native C decode kernel and with the torch path (``PLUGINFER_NATIVE=0``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from pluginfer.backends.cpu import backend as cpu
from pluginfer.backends.cpu import layer_ops as native_layer_ops
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu.backend import CpuBackend
from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import KVCacheSpec
from tests.backends.paged import paged_batch

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16
BLOCK_SIZE, NUM_BLOCKS = 4, 64
SCALE = HEAD_DIM**-0.5
FP32_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
# bf16 cache and queries: inputs are rounded to 8 significant bits before the kernel sees them (the reference
# uses the same rounded values), then scores, probabilities and the output are rounded again: ~2**-7 relative
# on outputs of magnitude ~1.
BF16_TOLERANCE = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These shapes are tiny: on a busy 2-core machine torch's thread handoffs cost more than the ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["native", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[CpuBackend]:
    if request.param == "native":
        reason = native.available()
        if reason is not None:
            pytest.skip(f"native kernels unavailable: {reason}")
        backend = cpu.build()
        assert backend.native_kernels
        yield backend
        return
    monkeypatch.setenv("PLUGINFER_NATIVE", "0")
    native_library.load.cache_clear()
    backend = cpu.build()
    assert not backend.native_kernels
    yield backend
    native_library.load.cache_clear()


@dataclass
class Step:
    """One step over a paged cache, plus the dense tensors the reference attends over."""

    batch: ForwardBatch
    query: torch.Tensor  # [tokens, heads, dim]
    key: torch.Tensor  # [tokens, kv_heads, dim]: this step's new keys
    value: torch.Tensor
    cache: tuple[torch.Tensor, torch.Tensor]
    all_keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, dim]: cached then new
    all_values: list[torch.Tensor]


def build_step(backend: CpuBackend, seq_lens: list[int], query_lens: list[int], v_dim: int = HEAD_DIM,
               dtype: torch.dtype = torch.float32, query_scale: float = 1.0, seed: int = 0,
               kv_heads: int = KV_HEADS) -> Step:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(dtype)

    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_dim=HEAD_DIM, v_head_dim=v_dim)
    key_cache, value_cache = backend.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, dtype)[0]
    # Slots nobody owns hold large garbage: reading one by mistake moves the result far out of tolerance.
    key_cache.copy_(randn(*key_cache.shape, scale=30.0))
    value_cache.copy_(randn(*value_cache.shape, scale=30.0))
    # Non-contiguous blocks in random order; block 0 (the padding value of block tables) is in use too.
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables, all_keys, all_values = [], [], []
    flat_keys, flat_values = key_cache.view(-1, kv_heads, HEAD_DIM), value_cache.view(-1, kv_heads, v_dim)
    for seq_len, query_len in zip(seq_lens, query_lens, strict=True):
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        tables.append(blocks)
        keys, values = randn(seq_len, kv_heads, HEAD_DIM), randn(seq_len, kv_heads, v_dim)
        cached = torch.arange(seq_len - query_len)
        slots = torch.tensor(blocks)[cached // BLOCK_SIZE] * BLOCK_SIZE + cached % BLOCK_SIZE
        flat_keys[slots], flat_values[slots] = keys[: len(cached)], values[: len(cached)]
        all_keys.append(keys)
        all_values.append(values)
    batch = paged_batch(backend, tables, seq_lens, query_lens, BLOCK_SIZE)
    new_keys = torch.cat([k[s - q:] for k, s, q in zip(all_keys, seq_lens, query_lens, strict=True)])
    new_values = torch.cat([v[s - q:] for v, s, q in zip(all_values, seq_lens, query_lens, strict=True)])
    query = randn(len(batch.positions), HEADS, HEAD_DIM, scale=query_scale)
    return Step(batch, query, new_keys, new_values, (key_cache, value_cache), all_keys, all_values)


def reference(step: Step, sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """Dense causal attention per sequence in float64 over its own keys; GQA by repeating KV heads."""
    outputs = []
    batch = step.batch
    for i, (keys, values) in enumerate(zip(step.all_keys, step.all_values, strict=True)):
        group = HEADS // keys.shape[1]
        query = step.query[batch.query_start_loc[i]: batch.query_start_loc[i + 1]].double()
        keys = keys.double().repeat_interleave(group, dim=1)
        values = values.double().repeat_interleave(group, dim=1)
        seq_len, query_len = keys.shape[0], query.shape[0]
        scores = query.transpose(0, 1) @ keys.permute(1, 2, 0) * SCALE  # [heads, queries, keys]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        query_positions = torch.arange(seq_len - query_len, seq_len)[:, None]
        key_positions = torch.arange(seq_len)[None, :]
        allowed = key_positions <= query_positions
        if sliding_window is not None:
            allowed &= key_positions > query_positions - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outputs.append((scores.softmax(-1) @ values.transpose(0, 1)).transpose(0, 1))
    return torch.cat(outputs)


# (seq_lens, query_lens): decodes first, then prefills, as the scheduler orders them.
CASES = {
    "decode": ([7, 1, 13, 33, 16], [1, 1, 1, 1, 1]),
    "prefill": ([5, 12, 1, 9], [5, 12, 1, 9]),
    "prefill-after-cached-tokens": ([20, 11, 8], [6, 3, 8]),
    "mixed": ([9, 17, 1, 6, 30, 13], [1, 1, 1, 6, 12, 2]),
    "prefill-before-decode": ([6, 9, 30, 17], [6, 1, 12, 1]),
}


def run(backend: CpuBackend, step: Step, **kwargs: object) -> torch.Tensor:
    return backend.paged_attention(step.query, step.key, step.value, step.cache, step.batch, SCALE, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_reference(backend: CpuBackend, case: str) -> None:
    step = build_step(backend, *CASES[case])
    out = run(backend, step)
    assert out.shape == (step.batch.num_tokens, HEADS, HEAD_DIM) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(step), **FP32_TOLERANCE)


@pytest.mark.parametrize("case", ["decode", "prefill-after-cached-tokens", "mixed"])
@pytest.mark.parametrize("sliding_window", [1, 5])
def test_sliding_window_smaller_than_the_sequences(backend: CpuBackend, case: str, sliding_window: int) -> None:
    step = build_step(backend, *CASES[case], seed=1)
    out = run(backend, step, sliding_window=sliding_window)
    torch.testing.assert_close(out.double(), reference(step, sliding_window=sliding_window), **FP32_TOLERANCE)
    # Not vacuous: these sequences are longer than the window, so the window changes the result.
    assert (reference(step) - reference(step, sliding_window=sliding_window)).abs().max() > 0.1


@pytest.mark.parametrize("case", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_logit_soft_cap(backend: CpuBackend, case: str, sliding_window: int | None) -> None:
    cap = 5.0
    step = build_step(backend, *CASES[case], query_scale=6.0, seed=2)  # scores well past the cap
    out = run(backend, step, sliding_window=sliding_window, logit_soft_cap=cap)
    expected = reference(step, sliding_window, soft_cap=cap)
    torch.testing.assert_close(out.double(), expected, **FP32_TOLERANCE)
    assert (expected - reference(step, sliding_window)).abs().max() > 0.1


def test_value_head_dim_differs_from_key_head_dim(backend: CpuBackend) -> None:
    step = build_step(backend, *CASES["mixed"], v_dim=24, seed=3)
    out = run(backend, step, sliding_window=7)
    assert out.shape == (step.batch.num_tokens, HEADS, 24)
    torch.testing.assert_close(out.double(), reference(step, sliding_window=7), **FP32_TOLERANCE)


def test_bfloat16_cache(backend: CpuBackend) -> None:
    """The native kernel is float32 only: a bf16 cache must take the torch path for its decodes too."""
    step = build_step(backend, *CASES["mixed"], dtype=torch.bfloat16, seed=4)
    out = run(backend, step)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(step), **BF16_TOLERANCE)


def test_a_bfloat16_query_over_a_float16_cache(backend: CpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 model with ``kv_cache_dtype`` float16: its decode rows take the native kernel with the query widened
    to float32 (the result back in bfloat16), not the torch path; the reference attends with the same query."""
    if not backend.native_kernels:
        pytest.skip("the torch-path backend (PLUGINFER_NATIVE=0): no native kernel to reach")
    step = build_step(backend, *CASES["decode"], dtype=torch.float16, seed=4)
    step.query = step.query.to(torch.bfloat16)
    queries = []
    kernel = native_layer_ops.paged_decode_attention
    monkeypatch.setattr(native_layer_ops, "paged_decode_attention",
                        lambda query, *args: queries.append(query.dtype) or kernel(query, *args))
    out = run(backend, step)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(step), **BF16_TOLERANCE)
    assert queries == [torch.float32], "the decode rows did not reach the native kernel with a float32 query"


@pytest.mark.parametrize("case", list(CASES))
def test_a_float32_query_over_a_float16_cache(backend: CpuBackend, case: str) -> None:
    """A GGUF model's default: float32 queries and new rows over a float16 cache. Each path widens the cached rows
    and keeps the query as it is, so only the cache's own rounding (made when written) separates the result
    from float32 attention."""
    step = build_step(backend, *CASES[case], dtype=torch.float16, seed=6)
    step.query = torch.randn(step.query.shape, generator=torch.Generator().manual_seed(7))  # not float16-exact
    step.key, step.value = step.key.float(), step.value.float()  # rounded to the cache's dtype when written
    out = run(backend, step)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(step), **FP32_TOLERANCE)


@pytest.mark.parametrize("case", list(CASES))
def test_new_keys_and_values_are_written_to_their_slots(backend: CpuBackend, case: str) -> None:
    step = build_step(backend, *CASES[case], seed=5)
    key_before, value_before = (c.clone() for c in step.cache)
    run(backend, step)
    slots = step.batch.slot_mapping
    for cache, before, new in ((step.cache[0], key_before, step.key), (step.cache[1], value_before, step.value)):
        flat, flat_before = cache.view(-1, *cache.shape[2:]), before.view(-1, *before.shape[2:])
        assert torch.equal(flat[slots], new)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(flat[untouched], flat_before[untouched]), "only the slot_mapping slots change"
    # And the slots are the ones the block tables name for each new position.
    for i, blocks in enumerate(step.batch.block_tables.tolist()):
        rows = slice(int(step.batch.query_start_loc[i]), int(step.batch.query_start_loc[i + 1]))
        for position, key in zip(step.batch.positions[rows].tolist(), step.key[rows], strict=True):
            block, offset = blocks[position // BLOCK_SIZE], position % BLOCK_SIZE
            assert torch.equal(step.cache[0][block, offset], key)


def test_metadata_is_shared_by_layers(backend: CpuBackend) -> None:
    """prepare runs once per step; every layer (its own cache, its own window) reuses batch.attention."""
    step = build_step(backend, *CASES["mixed"], seed=6)
    # A second layer: same slots, other contents (keys negated, values doubled, other queries).
    key_cache, value_cache = step.cache
    second = Step(step.batch, step.query.flip(1), -step.key, 2 * step.value, (-key_cache, 2 * value_cache),
                  [-k for k in step.all_keys], [2 * v for v in step.all_values])
    for window in (None, 4, None):
        for layer in (step, second):
            torch.testing.assert_close(run(backend, layer, sliding_window=window).double(),
                                       reference(layer, sliding_window=window), **FP32_TOLERANCE)


@pytest.fixture
def native_kernel() -> None:
    reason = native.available()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")


@pytest.mark.usefixtures("native_kernel")
@pytest.mark.parametrize(("kv_heads", "v_dim", "sliding_window", "soft_cap"), [
    (KV_HEADS, HEAD_DIM, None, None),
    (HEADS, HEAD_DIM, None, None),  # multi-head: one query head per KV head
    (1, HEAD_DIM, 9, None),  # multi-query
    (KV_HEADS, 24, 9, 5.0),
])
def test_native_paged_decode_attention_directly(kv_heads: int, v_dim: int, sliding_window: int | None,
                                                soft_cap: float | None) -> None:
    seq_lens = [1, 3, 4, 5, 40, 150]
    step = build_step(CpuBackend(), seq_lens, [1] * len(seq_lens), v_dim=v_dim, query_scale=3.0, seed=8,
                      kv_heads=kv_heads)
    # The kernel only reads the cache: write this step's keys the way paged_attention does first.
    for cache, new in zip(step.cache, (step.key, step.value), strict=True):
        cache.view(-1, *cache.shape[2:])[step.batch.slot_mapping] = new
    out = native_layer_ops.paged_decode_attention(step.query, *step.cache, step.batch.block_tables, step.batch.seq_lens,
                                                  SCALE, sliding_window, soft_cap)
    assert out.shape == (len(seq_lens), HEADS, v_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(step, sliding_window, soft_cap), **FP32_TOLERANCE)




@pytest.mark.usefixtures("native_kernel")
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "soft_cap"), [(32, None), (40, None), (32, 5.0)])  # 40, soft cap: portable loop
def test_a_16_bit_cache_decodes_as_the_float32_kernel_on_the_widened_cache(cache_dtype: torch.dtype, head_dim: int,
                                                                           soft_cap: float | None) -> None:
    """A float32 query over a 16-bit cache widens each cached value exactly, then runs the float32 kernel's
    operations in its order: the same bits as that kernel over the cache widened first."""
    generator = torch.Generator().manual_seed(5)
    block_size, seq_lens, heads, kv_heads = 8, [1, 9, 40, 77], 8, 2
    num_blocks = len(seq_lens) * 10
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype)
    tables = torch.randperm(num_blocks, generator=generator).reshape(len(seq_lens), 10)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=generator)
    args = (tables, torch.tensor(seq_lens), head_dim ** -0.5, None, soft_cap)
    out = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, *args)
    widened = native_layer_ops.paged_decode_attention(query, key_cache.float(), value_cache.float(), *args)
    assert torch.equal(out, widened)


@pytest.mark.usefixtures("native_kernel")
def test_native_paged_decode_attention_accepts_a_sliced_block_table() -> None:
    seq_lens = [5, 40, 9]
    step = build_step(CpuBackend(), seq_lens, [1] * len(seq_lens), seed=9)
    for cache, new in zip(step.cache, (step.key, step.value), strict=True):
        cache.view(-1, *cache.shape[2:])[step.batch.slot_mapping] = new
    tables = step.batch.block_tables
    wide = torch.zeros(tables.shape[0], tables.shape[1] + 6, dtype=torch.int64)
    wide[:, : tables.shape[1]] = tables  # the block ids stay valid: a wrong read gives wrong numbers, no crash
    out = native_layer_ops.paged_decode_attention(step.query, *step.cache, wide[:, : tables.shape[1]], step.batch.seq_lens,
                                                  SCALE, None, None)
    torch.testing.assert_close(out.double(), reference(step), **FP32_TOLERANCE)


@pytest.mark.usefixtures("native_kernel")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "v_dim", "sliding_window"), [
    (16, 8, 64, 64, None),  # the AVX-512 path: dims that are multiples of 16
    (8, 2, 128, 128, 20),
    (4, 4, 64, 80, None),  # a value dim that is not a whole number of 4-register chunks
    (6, 1, 32, 16, None),
    (4, 2, 40, 40, None),  # dims that are not multiples of 16 take the portable loop
])
def test_native_decode_attention_head_dims(heads: int, kv_heads: int, head_dim: int, v_dim: int,
                                           sliding_window: int | None) -> None:
    """Against a float64 gather-and-softmax reference, with lengths around the 16-position chunks."""
    generator = torch.Generator().manual_seed(3)
    block_size, seq_lens = 16, [1, 15, 16, 17, 33, 150]
    blocks_per_seq = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * blocks_per_seq + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, v_dim, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * blocks_per_seq]
    tables = tables.reshape(len(seq_lens), blocks_per_seq)
    query = 2 * torch.randn(len(seq_lens), heads, head_dim, generator=generator)
    scale = head_dim ** -0.5
    out = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, torch.tensor(seq_lens), scale,
                                                  sliding_window, None)
    for s, length in enumerate(seq_lens):
        first = max(0, length - sliding_window) if sliding_window else 0
        slots = (tables[s, torch.arange(first, length) // block_size] * block_size
                 + torch.arange(first, length) % block_size)
        keys = key_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        values = value_cache.reshape(-1, kv_heads, v_dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", query[s].double(), keys) * scale, dim=-1)
        expected = torch.einsum("ht,thd->hd", probs, values)
        torch.testing.assert_close(out[s].double(), expected, atol=2e-5, rtol=2e-5)
