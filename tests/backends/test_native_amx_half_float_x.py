"""float32 activations against 16-bit weights on the AMX bfloat16 tiles (``amx_half_weight_linear``).

The oracle is exact arithmetic (float64) on the float32 x and the 16-bit weights. Each x is split exactly
into three bfloat16 parts (hi, mid, lo; a part below 2^-126 is flushed by the tiles: |r| < 2^-125), a
float16 w exactly into two; the products are exact in float32 and summed in float32. With ``S`` the sum of
``|x_i w_i|`` and ``|bias|``: bfloat16 w, 3 products a pair: ``|s - e| <= (3k + 1) 2^-24 1.01 S + 2^-125
sum |w_i|``; float16 w, 5 products a pair (w's low part times x's low part left out, each < 2^-22 |x_i w_i|):
``|s - e| <= 2^-22 S + (5k + 1) 2^-24 1.01 S + 2^-125 sum |w_i|``. A row's result does not depend on the rows
beside it or the thread count (bit for bit); a NaN or an infinity in a row reaches only that row.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pluginfer.backends.cpu import amx_half
from pluginfer.backends.cpu import half_linear as native_half_linear
from tests.backends import half_linear_cases
from tests.backends.amx import require_amx

DTYPES = [torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 7), (17, 33), (40, 64), (65, 97), (130, 1030)]
ROWS = [1, 2, 5, 8, 15, 16, 17, 24, 33, 64]


@pytest.fixture(scope="module", autouse=True)
def amx() -> None:
    require_amx(amx_half.library, {"amx_tile", "amx_bf16", "avx512_bf16"}, "AMX-BF16",
                "the GEMV of half_linear.c and torch's GEMM take every row count", "the AMX bfloat16 kernel")


inputs = functools.partial(half_linear_cases.inputs, activations=torch.float32)  # float32 x and bias


def bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    value, size = half_linear_cases.exact(x, weight, bias)
    k = x.shape[-1]
    tiny = 2.0**-125 * weight.double().abs().sum(dim=1)
    if weight.dtype == torch.bfloat16:
        return value, tiny + (3 * k + 1) * 2.0**-24 * 1.01 * size
    return value, tiny + 2.0**-22 * size + (5 * k + 1) * 2.0**-24 * 1.01 * size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_within_the_stated_bound_of_exact_arithmetic(dtype: torch.dtype, shape: tuple[int, int], set_threads) -> None:
    out_features, in_features = shape
    for count in (1, 2):
        set_threads(count)
        for rows in ROWS:
            for with_bias in (False, True):
                x, weight, bias = inputs(rows, out_features, in_features, dtype, rows * 7 + count, with_bias)
                out = amx_half.linear_float_x(x, weight, bias)
                assert out.dtype == torch.float32 and out.shape == (rows, out_features)
                exact, limit = bound(x, weight, bias)
                error = (out.double() - exact).abs()
                assert bool((error <= limit).all()), f"{rows} rows: error {float((error - limit).max())} over"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_split_of_x_loses_no_bit(dtype: torch.dtype) -> None:
    # one input, weight 1: the output is hi + mid + lo summed in float32, x itself for |x| >= 2^-102
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1, generator=generator) * torch.logspace(-30, 30, 64).unsqueeze(1)
    x[0, 0], x[1, 0], x[2, 0] = 1 + 2.0**-23, -(2 - 2.0**-23), 1 + 2.0**-8 + 2.0**-16
    out = amx_half.linear_float_x(x, torch.ones(1, 1, dtype=dtype))
    assert torch.equal(out, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_is_the_same_bits_whatever_its_batch_and_threads(dtype: torch.dtype, set_threads) -> None:
    x, weight, bias = inputs(64, 130, 1030, dtype, 11, True)
    set_threads(1)
    whole = amx_half.linear_float_x(x, weight, bias)
    set_threads(2)
    assert torch.equal(amx_half.linear_float_x(x, weight, bias), whole)
    for start, stop in ((0, 1), (5, 6), (3, 20), (16, 33), (40, 64)):
        assert torch.equal(amx_half.linear_float_x(x[start:stop], weight, bias), whole[start:stop])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_past_one_sweep_are_the_same_bits_and_within_the_bound(dtype: torch.dtype, set_threads) -> None:
    """4100 inputs: one pass of 64 rows' B tiles already exceeds the C file's sweep (512 KiB), so 150 rows take
    three sweeps over the weights; each row the same bits as alone, within the stated bound."""
    x, weight, bias = inputs(150, 40, 4100, dtype, 13, True)
    set_threads(2)
    whole = amx_half.linear_float_x(x, weight, bias)
    value, allowed = bound(x, weight, bias)
    assert ((whole.double() - value).abs() <= allowed).all()
    set_threads(1)
    assert torch.equal(amx_half.linear_float_x(x, weight, bias), whole)
    for start in (0, 64, 130, 149):
        assert torch.equal(amx_half.linear_float_x(x[start:start + 1], weight, bias), whole[start:start + 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_infinite_rows_reach_only_their_own_row(dtype: torch.dtype) -> None:
    x, weight, bias = inputs(20, 40, 70, dtype, 5, True)
    clean = amx_half.linear_float_x(x, weight, bias)
    x[3, 10], x[7, 0], x[12, 69] = float("nan"), float("inf"), float("-inf")
    out = amx_half.linear_float_x(x, weight, bias)
    for row in (3, 7, 12):
        assert not bool(torch.isfinite(out[row]).any())
    others = [r for r in range(20) if r not in (3, 7, 12)]
    assert torch.equal(out[others], clean[others])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_half_linear_hands_the_measured_rows_of_float32_x_to_the_tiles(dtype: torch.dtype) -> None:
    """From FLOAT_X_MIN_ROWS (the GEMV below) to FLOAT_X_MAX_ROWS, past the GEMV's own limit (the prefill: the
    caller's float32 tiles above)."""
    low, high = amx_half.FLOAT_X_MIN_ROWS[dtype], amx_half.FLOAT_X_MAX_ROWS[dtype]
    assert high > native_half_linear.HALF_WEIGHT_MAX_ROWS
    for rows in (low, 16, native_half_linear.HALF_WEIGHT_MAX_ROWS + 1, 130, high):
        x, weight, bias = inputs(rows, 65, 97, dtype, rows, True)
        assert amx_half.takes_float_x(dtype, rows)
        assert torch.equal(native_half_linear.half_linear(x, weight, bias), amx_half.linear_float_x(x, weight, bias))
    assert not amx_half.takes_float_x(dtype, low - 1) and not amx_half.takes_float_x(dtype, high + 1)


def test_a_float32_out_only() -> None:
    x, weight, _ = inputs(4, 16, 32, torch.float16, 1, False)
    assert amx_half.linear_float_x(x, weight, out_dtype=torch.float16) is None
    assert amx_half.linear_float_x(x, weight, torch.zeros(16, dtype=torch.float16)) is None
