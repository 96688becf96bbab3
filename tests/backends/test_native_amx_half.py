"""The AMX bfloat16 tile kernel for 16-bit linears (``backends/amx_half.py``, ``csrc/amx_half.c``).

The oracle is exact arithmetic on the same 16-bit values (float64 here, exact for these sizes).
bfloat16: every product of two bfloat16 values is exact in float32 and the tiles add the k products
into a float32 accumulator, so ``|s - e| <= (k + 1) * 2^-24 * S`` with ``S`` the sum of ``|x_i w_i|``
and ``|bias|``, as for the GEMV (test_native_half_linear.py). float16: each value is split exactly into
two bfloat16 (hi, lo), so each input pair gives four exact products whose sum is ``x_i w_i``; the float32
sum then has 4k terms plus the bias, of total size at most ``(1 + 2^-8)^2 S``:
``|s - e| <= (4k + 1) * 2^-24 * 1.01 * S``. A 16-bit output is the float32 result rounded once to
nearest even (bit for bit against torch's conversion). A row's result is the same bits whatever rows
share its call (batch invariance) and whatever the thread count; float16's split loses no bit (a single
product is exact; an infinite weight stays infinite).
"""

from __future__ import annotations

import logging

import pytest
import torch

from pluginfer.backends.cpu import amx_half
from pluginfer.backends.cpu import half_linear as native_half_linear
from pluginfer.backends.cpu import library as native_library
from tests.backends.amx import require_amx
from tests.backends.half_linear_cases import exact, inputs

DTYPES = [torch.bfloat16, torch.float16]
# (out, in): outputs past a 16-row tile, inputs past a 32-input step, inputs shorter than one step.
SHAPES = [(1, 1), (3, 7), (16, 32), (17, 33), (40, 64), (65, 97), (33, 257), (130, 1030)]
ROWS = [1, 2, 3, 15, 16, 17, 33, 64, 70]


@pytest.fixture(scope="module", autouse=True)
def amx() -> None:
    require_amx(amx_half.library, {"amx_tile", "amx_bf16", "avx512_bf16"}, "AMX-BF16",
                "the GEMV of half_linear.c and torch's GEMM take every row count", "the AMX bfloat16 kernel")


def bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result and the float32 bound of the kernel's sum around it."""
    value, size = exact(x, weight, bias)
    k = x.shape[-1]
    if weight.dtype == torch.bfloat16:
        return value, (k + 1) * 2.0**-24 * size
    return value, (4 * k + 1) * 2.0**-24 * 1.01 * size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_within_the_float32_bound_of_exact_arithmetic(dtype: torch.dtype, shape: tuple[int, int], set_threads) -> None:
    out_features, in_features = shape
    for count in (1, 2):
        set_threads(count)
        for rows in ROWS:
            for with_bias in (False, True):
                x, weight, bias = inputs(rows, out_features, in_features, dtype, rows * 7 + count, with_bias)
                out = amx_half.linear(x, weight, bias, out_dtype=torch.float32)
                assert out.dtype == torch.float32 and out.shape == (rows, out_features)
                value, allowed = bound(x, weight, bias)
                error = (out.double() - value).abs()
                assert (error <= allowed).all(), (count, rows, with_bias, (error - allowed).max().item())
                # the 16-bit output is that float32 result rounded once to nearest even
                rounded = amx_half.linear(x, weight, bias)
                assert rounded.dtype == dtype
                assert torch.equal(rounded.view(torch.int16), out.to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_is_the_same_bits_whatever_its_batch_and_threads(dtype: torch.dtype, set_threads) -> None:
    x, weight, bias = inputs(70, 130, 1030, dtype, 3, True)
    set_threads(1)
    alone = torch.cat([amx_half.linear(x[r:r + 1], weight, bias, out_dtype=torch.float32) for r in range(70)])
    for rows in (2, 5, 16, 17, 48, 64, 70):
        for count in (1, 2):
            set_threads(count)
            together = amx_half.linear(x[:rows], weight, bias, out_dtype=torch.float32)
            assert torch.equal(together, alone[:rows]), (rows, count)
    # a row in another lane of its group, or another group: same bits
    set_threads(1)
    shuffled = torch.flip(x, dims=[0])
    assert torch.equal(amx_half.linear(shuffled, weight, bias, out_dtype=torch.float32), torch.flip(alone, dims=[0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_past_one_sweep_are_the_same_bits_and_within_the_bound(dtype: torch.dtype, set_threads) -> None:
    """4100 inputs: one pass of 64 rows' B tiles already exceeds the C file's sweep (512 KiB), so 150 rows take
    three sweeps over the weights; each row the same bits as alone, within the float32 bound."""
    x, weight, bias = inputs(150, 40, 4100, dtype, 13, True)
    set_threads(2)
    whole = amx_half.linear(x, weight, bias, out_dtype=torch.float32)
    value, allowed = bound(x, weight, bias)
    assert ((whole.double() - value).abs() <= allowed).all()
    set_threads(1)
    assert torch.equal(amx_half.linear(x, weight, bias, out_dtype=torch.float32), whole)
    for start in (0, 64, 130, 149):
        alone = amx_half.linear(x[start:start + 1], weight, bias, out_dtype=torch.float32)
        assert torch.equal(alone, whole[start:start + 1])


def test_float16_split_loses_no_bit() -> None:
    """One product (k = 1) is exact whatever its operands' 11 significant bits: the four bfloat16 products of
    the split add up to it exactly. An infinite weight gives +-inf, or a NaN where x's low half is 0 (inf * 0,
    as the C file says), and only in its own output."""
    generator = torch.Generator().manual_seed(5)
    x = (torch.rand(64, 1, generator=generator) * 4 - 2).to(torch.float16)
    weight = (torch.rand(40, 1, generator=generator) * 4 - 2).to(torch.float16)
    weight[0, 0] = 1 + 2.0**-10  # every significand bit in use
    x[0, 0] = -(1 - 2.0**-11)
    out = amx_half.linear(x, weight, out_dtype=torch.float32)
    assert torch.equal(out.double(), x.double() @ weight.double().T)
    weight[1, 0], weight[2, 0] = float("inf"), float("-inf")
    out = amx_half.linear(x, weight, out_dtype=torch.float32)
    signs = torch.where(x[:, 0] > 0, 1.0, -1.0)
    low_zero = x[:, 0].float() == x[:, 0].float().view(torch.int32).bitwise_and(-65536).view(torch.float32)
    for column, sign in ((1, 1.0), (2, -1.0)):
        assert torch.equal(out[:, column].isnan(), low_zero)
        assert torch.equal(out[~low_zero, column], (sign * signs[~low_zero] * float("inf")))
    assert low_zero.any() and not low_zero.all()
    assert torch.isfinite(out[:, [0] + list(range(3, 40))]).all()


@pytest.mark.parametrize("layout", ["normal-rows-first", "shuffled"])
def test_every_finite_float16_value_splits_exactly_in_weights_and_x(layout: str) -> None:
    """The weights' and x's split (two routes in the C file: 16-bit integer operations for 32 normal values,
    float32 for a chunk with a zero or subnormal) gives hi + lo == v for every finite float16 value: each value
    once as a weight and once as x against the identity, whose one nonzero product per output is then exact.
    Sorted, the 61440 normal values fill whole 32-value chunks (the integer route); shuffled, most chunks hold
    a zero or subnormal among normal values."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.float16)
    finite = values[torch.isfinite(values)]
    normal = finite.abs() >= 2.0**-14
    finite = torch.cat([finite[normal], finite[~normal]])
    if layout == "shuffled":
        finite = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(3))]
    table = finite.reshape(-1, 32)  # 1984 x 32
    identity = torch.eye(32, dtype=torch.float16)
    as_weights = amx_half.linear(identity, table, out_dtype=torch.float32)
    assert torch.equal(as_weights, table.float().T)
    as_x = amx_half.linear(table, identity, out_dtype=torch.float32)
    assert torch.equal(as_x, table.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_nan_stays_in_its_row_and_output(dtype: torch.dtype) -> None:
    x, weight, _ = inputs(20, 40, 100, dtype, 9, False)
    x[3, 50] = float("nan")
    weight[7, 99] = float("nan")
    out = amx_half.linear(x, weight, out_dtype=torch.float32)
    nan = out.isnan()
    assert nan[3].all() and nan[:, 7].all()
    nan[3], nan[:, 7] = False, False
    assert not nan.any()


def test_empty_inputs_and_unhandled_layouts() -> None:
    weight = torch.randn(5, 0).to(torch.bfloat16)
    bias = torch.randn(5).to(torch.bfloat16)
    assert torch.equal(amx_half.linear(torch.empty(3, 0, dtype=torch.bfloat16), weight, bias), bias.expand(3, 5))
    weight = torch.randn(8, 16).to(torch.bfloat16)
    assert amx_half.linear(torch.randn(2, 16), weight) is None  # x of another dtype
    assert amx_half.linear(torch.randn(2, 16).to(torch.bfloat16), weight.t()) is None  # not contiguous
    assert amx_half.linear(torch.randn(2, 16).to(torch.bfloat16), weight.float()) is None  # float32 weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_half_linear_takes_the_tiles_in_their_range(dtype: torch.dtype) -> None:
    """``native_half_linear.half_linear`` (the engine's 16-bit linear) hands amx_half.MIN_ROWS..MAX_ROWS rows
    to the tiles (the same bits as calling them), fewer to the GEMV and more back to torch (None)."""
    low, high = amx_half.MIN_ROWS[dtype], amx_half.MAX_ROWS[dtype]
    assert high > native_half_linear.HALF_LINEAR_MAX_ROWS[dtype] >= low - 1
    for rows in (low, low + 1, 16, high):
        x, weight, bias = inputs(rows, 40, 100, dtype, rows, True)
        out = native_half_linear.half_linear(x.reshape(1, rows, 100), weight, bias)
        assert out.shape == (1, rows, 40)
        assert torch.equal(out[0].view(torch.int16), amx_half.linear(x, weight, bias).view(torch.int16))
        out = native_half_linear.half_linear(x, weight, bias, out_dtype=torch.float32)
        assert torch.equal(out, amx_half.linear(x, weight, bias, out_dtype=torch.float32))
    x, weight, bias = inputs(high + 1, 40, 100, dtype, 0, True)
    assert native_half_linear.half_linear(x, weight, bias) is None  # torch's GEMM


def test_the_log_line_says_which_rows(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(native_library, "_logged", set())
    monkeypatch.setattr(amx_half, "_library", [])
    caplog.set_level(logging.INFO, logger=native_library.__name__)
    assert amx_half.library() is not None and amx_half.library() is not None
    low, high = amx_half.MIN_ROWS, amx_half.MAX_ROWS
    assert [r.getMessage() for r in caplog.records] == [
        f"16-bit linears: AMX bfloat16 tiles from {low[torch.bfloat16]} to {high[torch.bfloat16]} rows of bfloat16, "
        f"{low[torch.float16]} to {high[torch.float16]} rows of float16"]
    monkeypatch.setattr(amx_half, "_library", [])
    monkeypatch.setenv(amx_half.ENV, "0")
    caplog.clear()
    assert amx_half.library() is None and not amx_half.takes(torch.bfloat16, 16)
    assert [r.getMessage() for r in caplog.records] == [
        "16-bit linears: no AMX bfloat16 tiles (PLUGINFER_AMX=0); the GEMV of half_linear.c and torch's GEMM"]
