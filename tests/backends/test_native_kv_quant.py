"""The cpu backend's quantized KV cache kernels (``csrc/kv_quant_attention.c``) against torch: the write's codes
equal torch's own int8 rounding and float8 conversions of ``x / scale`` (``layers/kv_quant.py``), and attention over
the codes equals float64 attention over the rows torch dequantizes, for decode and prefill rows in one call,
GQA, sliding windows, soft caps, and dims the vector path does not take. ``test_isa_variants`` runs this module
again under ``PLUGINFER_CPU_ISA=avx2``."""

from __future__ import annotations

import pytest
import torch

from pluginfer.backends.cpu import kv_quant as native_kv
from pluginfer.backends.cpu import library
from pluginfer.layers import attention_ops, kv_quant

pytestmark = pytest.mark.usefixtures("native_kernels")

DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["int8", "fp8_e4m3", "fp8_e5m2"]


def _torch_rows(x: torch.Tensor, dtype: torch.dtype, fixed: torch.Tensor | None = None) -> torch.Tensor:
    """Rows made by torch's own conversions: scale from the absmax (or fixed), codes by torch's round / float8 cast."""
    code_max = kv_quant.CODE_MAX[dtype]
    absmax = x.abs().amax(-1)
    scale = fixed.expand(x.shape[:-1]) if fixed is not None else torch.where(absmax > 0, absmax / code_max, 1.0)
    scaled = (x / scale[..., None]).clamp(-code_max, code_max)
    codes = scaled.round().to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    return torch.cat([codes.view(torch.uint8), scale.contiguous().view(torch.uint8).view(*scale.shape, 4)], -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("fixed", [False, True], ids=["own-scale", "fixed-scale"])
def test_the_write_equals_torchs_conversions(dtype: torch.dtype, fixed: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    tokens, heads, dim, blocks, block_size = 9, 3, 40, 4, 4
    x = torch.randn(tokens, heads, dim, generator=generator) * torch.logspace(-6, 2, dim)  # subnormal codes too
    x[2, 1] = 0.0  # a row of zeros: scale 1
    scales = torch.tensor([0.01, 0.5, 3.0]) if fixed else None  # 0.01: most codes clip
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    cache = torch.zeros(blocks, block_size, heads, dim + 4, dtype=dtype)
    native_kv.write(cache, slots, x, scales)
    written = cache.view(-1, heads, dim + 4).view(torch.uint8)[slots]
    assert torch.equal(written, _torch_rows(x, dtype, scales))
    reference = torch.zeros_like(cache)
    kv_quant.write_rows(reference, slots, x, scales)
    assert torch.equal(reference.view(torch.uint8), cache.view(torch.uint8))


def _batch(seq_lens: list[int], query_lens: list[int], block_size: int, generator: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor]:
    per_seq = -(-max(seq_lens) // block_size)
    tables = torch.randperm(len(seq_lens) * per_seq + 3, generator=generator)[:len(seq_lens) * per_seq]
    return tables.view(len(seq_lens), per_seq), torch.tensor([0, *query_lens]).cumsum(0)


def _reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
               starts: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None,
               soft_cap: float | None) -> torch.Tensor:
    """Dequantize every row with torch's own conversions, then float64 attention."""
    keys, values = (kv_quant.codes(c).double() * kv_quant.scales(c).double()[..., None] for c in (key_cache, value_cache))
    return attention_ops.paged_prefill_attention(query.double(), keys, values, tables, starts, seq_lens,
                                           int((starts[1:] - starts[:-1]).max()), scale, window, soft_cap)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "v_dim"), [
    (8, 2, 64, 64),  # GQA 4: the vector path
    (6, 6, 32, 48),  # no grouping, v_dim its own
    (10, 2, 20, 12),  # dims the vector path does not take: scalar
])
def test_attention_over_codes_equals_attention_over_dequantized_rows(
        dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, v_dim: int, threads: int) -> None:
    generator = torch.Generator().manual_seed(heads * head_dim)
    block_size = 8
    seq_lens, query_lens = [1, 37, 20, 64, 9], [1, 1, 20, 5, 3]  # two decodes, a whole prompt, two chunks
    tables, starts = _batch(seq_lens, query_lens, block_size, generator)
    blocks = int(tables.max()) + 1
    key_cache = torch.zeros(blocks, block_size, kv_heads, head_dim + 4, dtype=dtype)
    value_cache = torch.zeros(blocks, block_size, kv_heads, v_dim + 4, dtype=dtype)
    slots = [int(tables[s, p // block_size]) * block_size + p % block_size
             for s, n in enumerate(seq_lens) for p in range(n)]
    slots = torch.tensor(slots)
    native_kv.write(key_cache, slots, torch.randn(len(slots), kv_heads, head_dim, generator=generator) * 2)
    native_kv.write(value_cache, slots, torch.randn(len(slots), kv_heads, v_dim, generator=generator))
    query = torch.randn(int(starts[-1]), heads, head_dim, generator=generator)
    lens = torch.tensor(seq_lens)
    for window, soft_cap in ((None, None), (7, None), (None, 5.0)):
        out = native_kv.paged_attention(query, key_cache, value_cache, tables, starts, lens, 0.2, window, soft_cap)
        expected = _reference(query, key_cache, value_cache, tables, starts, lens, 0.2, window, soft_cap)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def test_a_16_bit_query_gets_its_result_in_its_dtype() -> None:
    generator = torch.Generator().manual_seed(3)
    key_cache = torch.zeros(2, 4, 1, 36, dtype=torch.int8)
    value_cache = torch.zeros(2, 4, 1, 36, dtype=torch.int8)
    slots = torch.arange(6)
    native_kv.write(key_cache, slots, torch.randn(6, 1, 32, generator=generator, dtype=torch.bfloat16))
    native_kv.write(value_cache, slots, torch.randn(6, 1, 32, generator=generator, dtype=torch.bfloat16))
    query = torch.randn(1, 2, 32, generator=generator).bfloat16()
    tables, starts, lens = torch.tensor([[0, 1]]), torch.tensor([0, 1]), torch.tensor([6])
    out = native_kv.paged_attention(query, key_cache, value_cache, tables, starts, lens, 0.3, None, None)
    assert out.dtype == torch.bfloat16
    expected = _reference(query.float(), key_cache, value_cache, tables, starts, lens, 0.3, None, None)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


def test_the_vector_width_is_the_instruction_sets() -> None:
    features = library.loaded_build["info"].features
    expected = 16 if "avx512f" in features else 8 if "avx2" in features else 1
    assert library.load().kv_quant_attention_width() == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_the_cpu_backend_native_and_torch_paths_and_the_reference_agree(dtype: torch.dtype) -> None:
    """A step of decodes and prefills through ``CpuBackend.paged_attention`` (write, then attend) with the native
    kernels, with them switched off (torch on dequantized rows), and through the core's reference ops; and
    ``FixedScaleKVCache``'s scales reach every row."""
    from pluginfer.backends.cpu.backend import CpuBackend
    from pluginfer.core.protocols import KVCacheSpec
    from pluginfer.layers.backend_base import BaseDeviceBackend
    from pluginfer.testing import backend_contract

    class Reference(BaseDeviceBackend):
        name = "reference"
        kv_cache_dtypes = (dtype,)

    generator = torch.Generator().manual_seed(5)
    tables, seq_lens, query_lens = [[3, 0], [1, 5, 2], [4]], [9, 21, 3], [1, 6, 3]
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=32)
    tokens = sum(query_lens)
    query = torch.randn(tokens, 4, 32, generator=generator)
    key, value = (torch.randn(tokens, 2, 32, generator=generator) for _ in range(2))
    fixed = (torch.tensor([0.02, 0.03]), torch.tensor([0.01, 0.04]))
    results = []
    for backend, native, scales in ((CpuBackend(), True, None), (CpuBackend(), False, None), (Reference("cpu"), None, None),
                                    (CpuBackend(), True, fixed), (CpuBackend(), False, fixed), (Reference("cpu"), None, fixed)):
        if native is not None:
            backend.native_kernels = native
        caches = backend.allocate_kv_cache(spec, 6, 8, dtype)[0]
        if scales is not None:
            caches = kv_quant.FixedScaleKVCache(*caches, *scales)
        # earlier tokens of each sequence, written by earlier steps
        history = backend_contract.paged_batch(torch.device("cpu"), tables, seq_lens,
                                               [s - q for s, q in zip(seq_lens, query_lens)], 8)
        past = torch.randn(history.slot_mapping.shape[0], 2, 32, generator=torch.Generator().manual_seed(6))
        kv_quant.write_rows(caches[0], history.slot_mapping, past, None if scales is None else scales[0])
        kv_quant.write_rows(caches[1], history.slot_mapping, -past, None if scales is None else scales[1])
        batch = backend_contract.paged_batch(torch.device("cpu"), tables, seq_lens, query_lens, 8)
        batch.attention = backend.prepare(batch)
        results.append((backend.paged_attention(query, key, value, caches, batch, 0.25), caches))
    for out, caches in results[1:3]:
        torch.testing.assert_close(out, results[0][0], atol=1e-5, rtol=1e-5)
        assert torch.equal(caches[0].view(torch.uint8), results[0][1][0].view(torch.uint8))
    for out, caches in results[4:]:
        torch.testing.assert_close(out, results[3][0], atol=1e-5, rtol=1e-5)
        assert torch.equal(caches[1].view(torch.uint8), results[3][1][1].view(torch.uint8))
    written = kv_quant.scales(results[3][1][0]).view(-1, 2)[batch.slot_mapping]
    assert torch.equal(written, fixed[0].expand_as(written))
