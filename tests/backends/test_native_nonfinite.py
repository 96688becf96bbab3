"""NaN and Inf through the cpu backend's C kernels, at one thread and at several: they reach the GEMM
(``panel_linear``), decode attention, RMSNorm, SiLU-and-mul and rotary kernels, and the expected result is
the plain torch (IEEE) computation's: NaN where it has NaN, the same infinities, the same finite values
elsewhere. (The kernels' other branches: tests/backends/test_native_branches.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import layer_ops as native_layer_ops
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import panels as native_panels
from tests.backends.paged import attention_reference, paged_inputs

pytestmark = pytest.mark.usefixtures("native_kernels")


def nonfinite(name: str) -> float:
    return {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[name]


# (what is set, its value) -> what the IEEE reference gives: see each kernel's test.
ATTENTION_SPECIALS = ["query-nan", "query-inf", "key-nan", "key-inf", "key--inf", "value-nan", "value-inf",
                      "key-nan-outside-window"]


@pytest.mark.parametrize("path", ["avx512", "portable", "soft-cap"])
@pytest.mark.parametrize("special", ATTENTION_SPECIALS)
def test_decode_attention_propagates_nan_like_torch(path: str, special: str, request: pytest.FixtureRequest) -> None:
    """Two sequences of 40 positions (three 16-position blocks), 4 query heads on 2 KV heads. One value is
    made non-finite in sequence 0; sequence 1 stays finite. Expected: the float64 reference of the same
    inputs: a NaN query head or key makes its heads' outputs NaN; a key of +inf (query feature positive)
    makes the score +inf and the softmax NaN; -inf makes it -inf, weight 0, finite output; a non-finite
    value reaches its feature of the outputs; a NaN key outside the sliding window is never read."""
    head_dim = 40 if path == "portable" else 64
    soft_cap = 5.0 if path == "soft-cap" else None
    window = 24 if special.endswith("outside-window") else None
    seq_lens = [40, 40]
    query, key_cache, value_cache, tables = paged_inputs(seq_lens, 4, 2, head_dim, head_dim, seed=3)
    where, kind = special.split("-", 1)
    kind = kind.removesuffix("-outside-window")
    value = nonfinite(kind)
    position = 5 if window else 18  # sequence 0, position 18: block 1, slot 2 (outside a window of 24: 5)
    block, slot = tables[0, position // 16], position % 16
    if where == "query":
        query[0, 1, 3] = value
    elif where == "key":
        key_cache[block, slot, 0, 7] = value
        query[0, :2, 7] = 1.0  # the score's sign is the key's: +inf or -inf for heads 0 and 1
    else:
        value_cache[block, slot, 0, 7] = value
    scale = head_dim ** -0.5
    out = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, torch.tensor(seq_lens), scale,
                                                  window, soft_cap)
    expected = attention_reference(query, key_cache, value_cache, tables, seq_lens, scale, window, soft_cap)
    # A soft cap maps an infinite score to +-cap: finite.
    finite = special in ("key--inf", "key-nan-outside-window") or (soft_cap is not None and special in (
        "query-inf", "key-inf"))
    assert torch.isfinite(expected[1]).all() and bool(torch.isfinite(expected[0]).all()) == finite
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5, equal_nan=True)


@pytest.mark.skipif(native.op("panel_linear") is None, reason="the panel GEMM is AVX-512 only; not built here")
@pytest.mark.parametrize("rows", [1, 3, 20])  # 4-panel tiles (up to 4 rows), 2-panel tiles of 14 rows
@pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=lambda n: f"{n}-thread")
def test_panel_linear_propagates_nan_and_inf_like_torch(rows: int, threads: int) -> None:
    """70 outputs (a masked last panel), 300 inputs (a 256-input block and a 44-input one). Expected: the
    IEEE sum of products (float64 reference): a NaN input makes its row NaN; +inf times w gives +-inf by
    w's sign, NaN where w is 0; a NaN weight makes its output NaN in every row, a NaN bias its output;
    the other rows and outputs are untouched (a row never depends on the rows batched with it)."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(70, 300, generator=generator)
    bias = torch.randn(70, generator=generator)
    weight[5, 7] = 0.0
    weight[40, 100] = float("nan")
    bias[66] = float("nan")
    x = torch.randn(rows, 300, generator=generator)
    x[0, 7] = float("inf")
    if rows > 1:
        x[1, 11] = float("nan")
    if rows > 2:
        x[2, 290] = float("-inf")  # in the second input block
    out = native_panels.panel_linear(x, native_panels.pack_panels(weight), 70, bias)
    expected = (x.double()[:, None, :] * weight.double()[None]).sum(-1) + bias.double()
    assert expected[0, 5].isnan() and expected[0].isinf().any() and expected[:, 40].isnan().all()
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4, equal_nan=True)
    if rows > 3:
        clean = torch.ones(70, dtype=torch.bool)
        clean[[40, 66]] = False
        assert torch.isfinite(out[3:, clean]).all()


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=lambda n: f"{n}-thread")
def test_rms_norm_propagates_nan_and_inf_like_torch(residual: bool, offset: float, threads: int) -> None:
    """Expected (torch's ``x * rsqrt(mean(x^2) + eps) * (w + offset)``): a NaN makes its row NaN; an inf
    makes mean(x^2) inf, so the inf element is inf * 0 = NaN and the rest of its row is 0; finite rows are
    untouched. With the fused residual add the sum (residual updated in place) carries the same values."""
    generator = torch.Generator().manual_seed(int(residual) + 2 * int(offset))
    x = torch.randn(12, 1400, generator=generator)  # 16800 values: above the kernel's OpenMP threshold (2**14)
    weight = torch.randn(1400, generator=generator)
    x[0, 5], x[1, 7], x[2, 9] = float("nan"), float("inf"), float("-inf")
    res = torch.randn(12, 1400, generator=generator) if residual else None
    source = x + res if residual else x
    expected = source * torch.rsqrt(source.pow(2).mean(-1, keepdim=True) + 1e-6) * (weight + offset)
    kept = res.clone() if residual else None
    out = native_layer_ops.rms_norm(x, kept, weight, 1e-6, offset)
    assert out is not None, "rms_norm declined float32 contiguous inputs it claims to handle"
    assert out[0].isnan().all() and out[1, 7].isnan() and (out[1, :7] == 0).all()
    torch.testing.assert_close(out, expected, equal_nan=True)
    if residual:
        torch.testing.assert_close(kept, source, equal_nan=True)


@pytest.mark.parametrize("n", [1376, 1381])  # whole 16-lane vectors; 86 vectors and a 5-element scalar tail
@pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=lambda n: f"{n}-thread")
def test_silu_and_mul_propagates_nan_and_inf_like_torch(n: int, threads: int) -> None:
    """Expected (torch's ``silu(gate) * up``): NaN gate -> NaN; +inf gate -> inf * up; -inf gate ->
    -inf * sigmoid(-inf) = -inf * 0 = NaN; gate 0 with up inf -> 0 * inf = NaN; NaN up -> NaN. Specials sit
    in the vector part (column 3) and in the scalar tail (column n - 1)."""
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(6, 2 * n, generator=generator)  # 6 rows of n: above the kernel's OpenMP threshold (2**13)
    for column in (3, n - 1):
        x[0, column] = float("nan")
        x[1, column] = float("inf")
        x[2, column] = float("-inf")
        x[3, column], x[3, n + column] = 0.0, float("inf")
        x[4, n + column] = float("nan")
    out = native_layer_ops.silu_and_mul(x)
    assert out is not None, "silu_and_mul declined float32 contiguous inputs it claims to handle"
    expected = F.silu(x[:, :n]) * x[:, n:]
    assert expected[[0, 2, 3, 4], 3].isnan().all() and expected[1, 3].isinf()
    torch.testing.assert_close(out, expected, equal_nan=True)


@pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=lambda n: f"{n}-thread")
def test_rotary_neox_keeps_nan_inside_its_pair(threads: int) -> None:
    """A NaN feature of one head reaches only the two features rotated together (i and i + half) of that
    head and token; an inf gives inf * cos + x * sin (NaN where cos or sin is 0, as torch computes it)."""
    generator = torch.Generator().manual_seed(4)
    tokens, heads, dim = 88, 4, 32  # 88 x 6 heads x 32: above the kernel's OpenMP threshold (2**14)
    query = torch.randn(tokens, heads, dim, generator=generator)
    key = torch.randn(tokens, 2, dim, generator=generator)
    angles = torch.rand(tokens, dim // 2, generator=generator) * 6
    cos, sin = angles.cos(), angles.sin()
    query[2, 1, 3], key[9, 0, 20] = float("nan"), float("inf")

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x[..., : dim // 2], x[..., dim // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([first * c - second * s, second * c + first * s], -1)

    expected_q, expected_k = rotate(query), rotate(key)
    assert native_layer_ops.rotary_neox(query, key, cos, sin, dim), "rotary_neox declined float32 inputs it claims to handle"
    torch.testing.assert_close(query, expected_q, equal_nan=True)
    torch.testing.assert_close(key, expected_k, equal_nan=True)
    assert query.isnan().sum() == 2 and query[2, 1, [3, 3 + dim // 2]].isnan().all()


