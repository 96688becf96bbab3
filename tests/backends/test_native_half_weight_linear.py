"""float32 activations against a bfloat16/float16 weight (``csrc/half_linear.c``'s ``half_weight_linear``, reached
through ``native_half_linear.half_linear`` with a float32 ``x``): a GGUF file's F16/BF16 tensors in a float32 model.

The bound: widening a 16-bit weight to float32 is exact, and each step of the kernel's sum is one fused
multiply-add (the exact ``s + x_i w_i``, rounded once), so the float32 result ``s`` differs from the exact
sum ``e`` (float64 here, exact for these sizes) only by the roundings of its additions, each at most
``2^-24`` of a partial sum, itself at most ``S`` = the sum of ``|x_i w_i|`` and ``|bias|``: ``|s - e| <=
(k + 2) * 2^-24 * S``. torch's ``x @ W.float().T`` is within the same of ``e``, so within twice of the
kernel. A row's result is the same bits whatever rows share its call.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pluginfer.backends.cpu import amx_half
from pluginfer.backends.cpu import half_linear as native_half_linear
from pluginfer.backends.cpu import ops as native
from tests.backends import half_linear_cases
from tests.backends.half_linear_cases import assert_nonfinite_as_exact, exact, plant_nonfinite

pytestmark = pytest.mark.skipif(native.available() is not None or native_half_linear.half_linear_isa() is None,
                                reason="the 16-bit GEMV needs AVX2 + FMA + F16C (and the native library)")

DTYPES = [torch.bfloat16, torch.float16]
# (out, in): inputs shorter than a vector, tails after whole vectors (the padded copy of x), whole vectors
# (x read in place), outputs past a tile, the tiny model's LM head.
SHAPES = [(1, 1), (3, 7), (9, 31), (17, 33), (40, 64), (65, 97), (33, 257), (130, 1030), (8, 1024), (2048, 256)]

inputs = functools.partial(half_linear_cases.inputs, activations=torch.float32)  # float32 x and bias


@pytest.fixture(autouse=True)
def gemv_at_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMV here at every row count (the engine hands amx_half.FLOAT_X_MIN_ROWS..MAX_ROWS rows to the AMX
    tiles, tested in test_native_amx_half_float_x.py)."""
    monkeypatch.setattr(amx_half, "FLOAT_X_MIN_ROWS", {})


def bound(size: torch.Tensor, k: int) -> torch.Tensor:
    return (k + 2) * 2.0**-24 * size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_within_the_float32_bound_of_exact_and_of_torch(dtype: torch.dtype, shape: tuple[int, int], set_threads) -> None:
    out_features, in_features = shape
    for count in (1, 2):
        set_threads(count)
        for rows in (1, 2, 3, 4, 7, native_half_linear.HALF_WEIGHT_MAX_ROWS):
            for with_bias in (False, True):
                x, weight, bias = inputs(rows, out_features, in_features, dtype, rows * 7 + count, with_bias)
                out = native_half_linear.half_linear(x, weight, bias)
                assert out.dtype == torch.float32 and out.shape == (rows, out_features)
                assert torch.equal(native_half_linear.half_linear(x, weight, bias, torch.float32), out)
                value, size = exact(x, weight, bias)
                assert ((out.double() - value).abs() <= bound(size, in_features)).all()
                reference = x @ weight.float().T + (bias if bias is not None else 0)
                assert ((out.double() - reference.double()).abs() <= 2 * bound(size, in_features)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_result_does_not_depend_on_its_batch(dtype: torch.dtype, set_threads) -> None:
    """Every row count up to the limit (tiles of 1, 2 and 3 rows), shuffled, 1 and 2 threads, both x paths."""
    rows = native_half_linear.HALF_WEIGHT_MAX_ROWS
    for in_features in (1000, 1024):
        x, weight, bias = inputs(rows, 77, in_features, dtype, 5, True)
        for count in (1, 2):
            set_threads(count)
            alone = torch.cat([native_half_linear.half_linear(row[None], weight, bias) for row in x])
            for batch in range(2, rows + 1):
                assert torch.equal(native_half_linear.half_linear(x[:batch], weight, bias), alone[:batch])
            shuffled = torch.randperm(rows, generator=torch.Generator().manual_seed(count))
            assert torch.equal(native_half_linear.half_linear(x[shuffled], weight, bias), alone[shuffled])
            assert torch.equal(native_half_linear.half_linear(x.view(2, rows // 2, in_features), weight, bias),
                               alone.view(2, rows // 2, 77))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_infinity_propagate_as_in_ieee_arithmetic(dtype: torch.dtype) -> None:
    x, weight, _ = inputs(5, 40, 70, dtype, 3, False)
    plant_nonfinite(x, weight)
    out = native_half_linear.half_linear(x, weight, None)
    value, size = exact(x, weight, None)
    assert_nonfinite_as_exact(out, value)
    finite = value.isfinite()
    assert ((out.double() - value).abs()[finite] <= bound(size, 70)[finite]).all()


def test_inputs_it_does_not_take_go_back_to_the_caller() -> None:
    x, weight, bias = inputs(4, 16, 32, torch.float16, 0, True)
    assert native_half_linear.half_linear(x, weight, bias.half()) is None  # a 16-bit bias with float32 x
    assert native_half_linear.half_linear(x.double(), weight, None) is None  # float64 activations
    assert native_half_linear.half_linear(x, weight, bias, torch.float16) is None  # a 16-bit output of float32 x
    assert native_half_linear.half_linear(x[:, :16], weight, bias) is None  # feature counts differ
    limit = native_half_linear.HALF_WEIGHT_MAX_ROWS
    many = torch.zeros(limit + 1, 32)
    assert native_half_linear.half_linear(many, weight, bias) is None  # past the limit: the caller's tiles
    assert native_half_linear.half_linear(many[:limit], weight, bias) is not None
    assert native_half_linear.half_linear(x[:0], weight, bias) is None
