"""The cpu backend's RMSNorm, SiLU-and-mul, rotary and decode attention kernels on float16 and bfloat16
tensors (``*_16`` in csrc/attention.c, norm.c, activation.c, rotary.c): values widened to float32 as they are loaded, float32 arithmetic,
results rounded to nearest even.

- rotary: equal bit for bit to the float32 rotation of the widened values, rounded once;
- decode attention (AVX-512 path: dims multiples of 16, no soft cap): equal bit for bit to the float32
  kernel on the widened query and caches, rounded once; the portable loop (other dims, soft cap, sliding
  window) within 1 unit in the last place of the 16-bit result of a float64 reference; a float32 query
  against 16-bit caches (``paged_decode_attention_kv16``, a float32 model's 16-bit KV cache) equal bit for
  bit to the float32 kernel on the widened caches, float32 out;
- RMSNorm and SiLU-and-mul round where the layers' torch references round (layers/norm.py: the residual
  sum, the normalised value, the product; layers/activation.py: silu(gate), the product), so they differ
  from them only by float32 sums in another order (RMSNorm's mean square) and expf against torch's exp: at
  most 2 units in the last place (one flipped rounding carried through the product), most values equal;
  the residual written back equals torch's ``x + residual`` bit for bit.
At 1 and 2 threads (the parallel branches start at 2**14 values (RMSNorm, rotary: tokens x heads x rotary
dim) / 2**13 (SiLU) / 2**20 multiply-adds (attention), on more than one row).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import layer_ops as native_layer_ops
from pluginfer.backends.cpu import library as native_library
from tests.backends.paged import paged_inputs

DTYPES = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # the spacing at 1 (relative unit in the last place)


pytestmark = pytest.mark.usefixtures("native_kernels")  # threads: tests/backends/conftest.py, 1 and 2


def assert_within_ulps(out: torch.Tensor, expected: torch.Tensor, ulps: float, min_equal: float) -> None:
    """|out - expected| <= ulps units in the last place of expected's dtype at |expected|, NaN where expected
    has NaN, and at least ``min_equal`` of the values equal bit for bit."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    a, b = out.double(), expected.double()
    assert torch.equal(a.isnan(), b.isnan())
    infinite = b.isinf()
    assert torch.equal(a[infinite], b[infinite])
    finite = b.isfinite()
    spacing = ULP[out.dtype] * torch.maximum(b.abs(), torch.full_like(b, torch.finfo(out.dtype).tiny))
    excess = ((a - b).abs() / spacing)[finite]
    assert bool((excess <= ulps).all()), float(excess.max())
    equal = (out.view(torch.int16) == expected.view(torch.int16)) | (a.isnan() & b.isnan())
    assert equal.double().mean() >= min_equal, float(equal.double().mean())


def torch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   offset: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """layers/norm.py's reference for 16-bit tensors."""
    if residual is not None:
        residual = x + residual
        x = residual
    dtype, xf = x.dtype, x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (weight.float() + offset)).to(dtype), residual
    return xf.to(dtype) * weight, residual


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 96), (17, 1000)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...], residual: bool, offset: float, threads: int) -> None:
    generator = torch.Generator().manual_seed(shape[-1] + int(residual))
    x = (3 * torch.randn(*shape, generator=generator)).to(dtype)
    x[0, ..., 1] = float("nan")  # one row NaN throughout, as torch's
    weight = torch.randn(shape[-1], generator=generator).to(dtype)
    kept = (torch.randn(*shape, generator=generator)).to(dtype) if residual else None
    expected, expected_residual = torch_rms_norm(x, kept, weight, 1e-5, offset)
    written = kept.clone() if kept is not None else None
    out = native_layer_ops.rms_norm(x, written, weight, 1e-5, offset)
    assert out is not None and out.dtype == dtype
    if residual:
        assert torch.equal(written.view(torch.int16), expected_residual.view(torch.int16))
    assert_within_ulps(out, expected, 2, 0.95)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 2 * 40), (2, 3, 2 * 96), (9, 2 * 1000)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...], threads: int) -> None:
    generator = torch.Generator().manual_seed(shape[-1])
    x = (4 * torch.randn(*shape, generator=generator)).to(dtype)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    gate, up = x.chunk(2, dim=-1)
    out = native_layer_ops.silu_and_mul(x)
    assert out is not None and out.dtype == dtype
    assert_within_ulps(out, F.silu(gate) * up, 1, 0.95)


def rotate_float32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, xf[..., rotary_dim:]), dim=-1)
    return rotated.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "head_dim", "rotary_dim"), [(3, 64, 64), (11, 80, 32), (48, 64, 64)])
def test_rotary_neox_equals_the_float32_rotation_rounded_once(dtype: torch.dtype, tokens: int, head_dim: int,
                                                              rotary_dim: int, threads: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    heads, kv_heads = 4, 2
    # q and k as views of one fused qkv buffer: token rows strided
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    query = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, rotary_dim // 2, generator=generator) * 100
    cos, sin = angles.cos(), angles.sin()
    expected_q, expected_k = rotate_float32(query, cos, sin, rotary_dim), rotate_float32(key, cos, sin, rotary_dim)
    value = qkv[:, (heads + kv_heads) * head_dim:].clone()
    assert native_layer_ops.rotary_neox(query, key, cos, sin, rotary_dim)
    assert torch.equal(query.view(torch.int16), expected_q.view(torch.int16))
    assert torch.equal(key.view(torch.int16), expected_k.view(torch.int16))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], value)  # the value columns untouched


# (seq_lens, heads, kv_heads, head_dim, v_dim, sliding_window, soft_cap)
ATTENTION = {
    "avx512": ([5, 37, 130], 8, 2, 64, 64, None, None),
    "avx512-threaded": ([1100, 700], 8, 4, 64, 64, None, None),
    "portable-dims": ([9, 70], 4, 2, 40, 40, None, None),
    "soft-cap-window": ([50, 200], 4, 4, 64, 32, 90, 30.0),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(ATTENTION))
def test_paged_decode_attention(dtype: torch.dtype, case: str, threads: int) -> None:
    seq_lens, heads, kv_heads, head_dim, v_dim, window, soft_cap = ATTENTION[case]
    query, key_cache, value_cache, tables = paged_inputs(seq_lens, heads, kv_heads, head_dim, v_dim, seed=len(case))
    query, key_cache, value_cache = query.to(dtype), key_cache.to(dtype), value_cache.to(dtype)
    lens, scale = torch.tensor(seq_lens), head_dim ** -0.5
    out = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, window, soft_cap)
    assert out.dtype == dtype and out.shape == (len(seq_lens), heads, v_dim)
    widened = native_layer_ops.paged_decode_attention(query.float(), key_cache.float(), value_cache.float(), tables, lens,
                                                      scale, window, soft_cap).to(dtype)
    if case.startswith("avx512") and native_library.load().panel_linear_supported():
        assert torch.equal(out.view(torch.int16), widened.view(torch.int16))
    else:  # the portable loops sum in another order; where +-v cancel, that moves a small result by 2 ulps
        assert_within_ulps(out, widened, 2, 0.9)
    torch.set_num_threads(1)
    single = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, window, soft_cap)
    assert torch.equal(out.view(torch.int16), single.view(torch.int16))  # the same bits at any thread count


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(ATTENTION))
def test_paged_decode_attention_float32_query_on_16_bit_caches(dtype: torch.dtype, case: str, threads: int) -> None:
    """A float32 model's 16-bit KV cache (paged_decode_attention_kv16): the query is not rounded, the result is
    float32, equal bit for bit to the float32 kernel on the widened caches (AVX-512 path), the portable loop
    within float32 sums in another order."""
    seq_lens, heads, kv_heads, head_dim, v_dim, window, soft_cap = ATTENTION[case]
    query, key_cache, value_cache, tables = paged_inputs(seq_lens, heads, kv_heads, head_dim, v_dim, seed=len(case))
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    lens, scale = torch.tensor(seq_lens), head_dim ** -0.5
    out = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, window, soft_cap)
    assert out.dtype == torch.float32 and out.shape == (len(seq_lens), heads, v_dim)
    widened = native_layer_ops.paged_decode_attention(query, key_cache.float(), value_cache.float(), tables, lens,
                                                      scale, window, soft_cap)
    if case.startswith("avx512") and native_library.load().panel_linear_supported():
        assert torch.equal(out.view(torch.int32), widened.view(torch.int32))
    else:  # the portable loop sums in another order than the float32 kernel's vectorised dot products
        torch.testing.assert_close(out, widened, rtol=1e-5, atol=1e-6)
    rounded_query = native_layer_ops.paged_decode_attention(query.to(dtype), key_cache, value_cache, tables, lens,
                                                            scale, window, soft_cap)
    assert rounded_query.dtype == dtype  # a 16-bit query keeps the 16-bit kernel
    torch.set_num_threads(1)
    single = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, window, soft_cap)
    assert torch.equal(out.view(torch.int32), single.view(torch.int32))  # the same bits at any thread count


def test_what_the_16_bit_kernels_decline() -> None:
    """Mixed dtypes and strided rows take the torch path (None / False), as for float32."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert native_layer_ops.rms_norm(x, None, torch.ones(64, dtype=torch.float16), 1e-5, 0.0) is None
    assert native_layer_ops.rms_norm(x, torch.zeros(4, 64), torch.ones(64, dtype=torch.bfloat16), 1e-5, 0.0) is None
    assert native_layer_ops.rms_norm(x.t(), None, torch.ones(4, dtype=torch.bfloat16), 1e-5, 0.0) is None
    assert native_layer_ops.silu_and_mul(torch.randn(4, 128, dtype=torch.bfloat16)[:, ::2]) is None
    query = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    assert not native_layer_ops.rotary_neox(query, query.half(), torch.ones(2, 32), torch.zeros(2, 32), 64)
