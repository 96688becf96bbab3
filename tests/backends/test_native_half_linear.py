"""The native 16-bit GEMV (``csrc/half_linear.c``, ``native_half_linear.half_linear``) against exact arithmetic and torch.

The bound: a product of two bfloat16 or two float16 values is exact in float32, so the kernel's
float32 result ``s`` of a row and an output differs from the exact sum ``e`` (float64 here, exact for
these sizes) only by the float32 additions: ``|s - e| <= (k + 1) * 2^-24 * S`` with ``S`` the sum of
``|x_i w_i|`` and ``|bias|`` (k products and the bias, any order). The 16-bit output then rounds
``s`` once: ``|out - e| <= (k + 1) * 2^-24 * S + u * (|e| + (k + 1) * 2^-24 * S) + tiny`` with
``u`` the unit roundoff of the dtype (bfloat16 2^-8, float16 2^-11) and ``tiny`` half the smallest
float16 subnormal. torch's ``F.linear`` sums in float32 too, in its own order: both are within that
of ``e``, so within twice of each other. A row's result is the same bits whatever rows share its call.
"""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import amx_half
from pluginfer.backends.cpu import build as native_build
from pluginfer.backends.cpu import half_linear as native_half_linear
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native
from tests.backends.half_linear_cases import assert_nonfinite_as_exact, exact, inputs, plant_nonfinite

pytestmark = pytest.mark.skipif(native.available() is not None or native_half_linear.half_linear_isa() is None,
                                reason="the 16-bit GEMV needs AVX2 + FMA + F16C (and the native library)")

DTYPES = [torch.bfloat16, torch.float16]
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# (out, in): odd sizes, inputs shorter than a vector, a tail after whole vectors, outputs past a tile.
SHAPES = [(1, 1), (3, 7), (9, 31), (17, 33), (40, 64), (65, 97), (33, 257), (130, 1030), (8, 1024)]


def float32_bound(size: torch.Tensor, k: int) -> torch.Tensor:
    return (k + 1) * 2.0**-24 * size


def rounded_bound(value: torch.Tensor, size: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    summed = float32_bound(size, k)
    return summed + UNIT[dtype] * (value.abs() + summed) + 2.0**-25


@pytest.fixture(autouse=True)
def any_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel at every row count here (the engine hands rows past the crossover to torch's GEMM, and
    rows in amx_half's range to the AMX tiles, tested in test_native_amx_half.py)."""
    monkeypatch.setattr(native_half_linear, "HALF_LINEAR_MAX_ROWS", dict.fromkeys(DTYPES, 64))
    monkeypatch.setattr(amx_half, "MIN_ROWS", {})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_within_the_float32_bound_of_exact_and_of_torch(dtype: torch.dtype, shape: tuple[int, int], set_threads) -> None:
    out_features, in_features = shape
    for count in (1, 2):
        set_threads(count)
        for rows in (1, 2, 3, 4, 7, 16):
            for with_bias in (False, True):
                x, weight, bias = inputs(rows, out_features, in_features, dtype, rows * 7 + count, with_bias)
                value, size = exact(x, weight, bias)
                summed = native_half_linear.half_linear(x, weight, bias, torch.float32)
                assert summed.dtype == torch.float32 and summed.shape == (rows, out_features)
                assert ((summed.double() - value).abs() <= float32_bound(size, in_features)).all()
                out = native_half_linear.half_linear(x, weight, bias)
                assert out.dtype == dtype
                bound = rounded_bound(value, size, in_features, dtype)
                assert ((out.double() - value).abs() <= bound).all()
                # The output is s rounded once, to nearest even, as torch rounds.
                assert torch.equal(out, summed.to(dtype))
                reference = F.linear(x, weight, bias)
                assert ((out.double() - reference.double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_leading_dimensions_and_the_lm_head_shape(dtype: torch.dtype) -> None:
    x, weight, bias = inputs(6, 300, 128, dtype, 1, True)
    out = native_half_linear.half_linear(x.view(2, 3, 128), weight, bias)
    assert out.shape == (2, 3, 300)
    assert torch.equal(out.view(6, 300), native_half_linear.half_linear(x, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_result_does_not_depend_on_its_batch(dtype: torch.dtype, set_threads) -> None:
    """Every row count up to the crossover (tiles of 1, 2 and 3 rows, blocks of 48), shuffled, 1 and 2 threads."""
    rows = 64
    x, weight, bias = inputs(rows, 77, 1000, dtype, 5, True)
    for count in (1, 2):
        set_threads(count)
        alone = torch.cat([native_half_linear.half_linear(row[None], weight, bias) for row in x])
        for batch in (2, 3, 4, 5, 16, 17, 47, 48, 49, rows):
            assert torch.equal(native_half_linear.half_linear(x[:batch], weight, bias), alone[:batch])
        shuffled = torch.randperm(rows, generator=torch.Generator().manual_seed(count))
        assert torch.equal(native_half_linear.half_linear(x[shuffled], weight, bias), alone[shuffled])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_infinity_propagate_as_in_ieee_arithmetic(dtype: torch.dtype) -> None:
    x, weight, bias = inputs(5, 40, 70, dtype, 3, False)
    plant_nonfinite(x, weight)
    out = native_half_linear.half_linear(x, weight, bias)
    value, _ = exact(x, weight, bias)
    assert_nonfinite_as_exact(out, value)
    assert out[1].isnan().all() and out[:, 9].isnan().all()
    finite = value.isfinite()
    assert ((out.double() - value).abs()[finite] <= rounded_bound(value, exact(x, weight, bias)[1], 70,
                                                                   dtype)[finite]).all()
    # a NaN in one row leaves the others as they are alone
    torch.testing.assert_close(out[0], native_half_linear.half_linear(x[:1], weight, bias)[0], rtol=0, atol=0, equal_nan=True)


def test_inputs_it_does_not_take_go_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the crossover as shipped
    monkeypatch.setattr(amx_half, "MIN_ROWS", {})  # without the AMX tiles (their range: test_native_amx_half.py)
    x, weight, bias = inputs(4, 16, 32, torch.bfloat16, 0, True)
    assert native_half_linear.half_linear(x.float(), weight, bias) is None  # dtypes differ
    assert native_half_linear.half_linear(x, weight.float(), None) is None  # a float32 weight: the panel kernel's
    assert native_half_linear.half_linear(x.half(), weight.half(), bias) is None  # bias of another dtype
    assert native_half_linear.half_linear(x, weight.t().contiguous().t(), bias) is None  # not [out, in] contiguous
    assert native_half_linear.half_linear(x[:, :16], weight, bias) is None  # feature counts differ
    limit = native_half_linear.HALF_LINEAR_MAX_ROWS[torch.bfloat16]
    many = torch.zeros(limit + 1, 32, dtype=torch.bfloat16)
    assert native_half_linear.half_linear(many, weight, bias) is None  # past the crossover: torch's GEMM
    assert native_half_linear.half_linear(many[:limit], weight, bias) is not None
    assert native_half_linear.half_linear(x[:0], weight, bias) is None


def test_op_and_the_log_line_saying_which_path(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.undo()  # the crossover as shipped
    monkeypatch.setattr(native_library, "_logged", set())
    monkeypatch.setattr(amx_half, "_library", [None])  # no AMX tiles (their line: test_native_amx_half.py)
    caplog.set_level(logging.INFO, logger=native_library.__name__)
    assert native.op("half_linear") is native_half_linear.half_linear
    native.op("half_linear")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"16-bit linears: native GEMV ({native_half_linear.half_linear_isa()}) up to 6 rows of bfloat16 and 16 of "
                 "float16, torch's matmul above")]
    caplog.clear()
    monkeypatch.setattr(native_half_linear, "half_linear_isa", lambda: None)  # a CPU without AVX2 + F16C
    assert native.op("half_linear") is None and native.op("half_linear") is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "16-bit linears: no bfloat16/float16 GEMV for this CPU (it needs AVX2 + F16C); torch's matmul")]


# The other instruction sets of half_linear.c, built here with the newer ones switched off.
VARIANTS = {"avx512-no-bf16": (("-mno-avx512bf16",), 2, "avx512f"), "avx2": (("-mno-avx512f",), 3, "avx2")}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    flags, supported, feature = VARIANTS[request.param]
    if feature not in native_build.cpu_features():
        pytest.skip(f"this CPU has no {feature}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLUGINFER_CACHE", str(tmp_path_factory.mktemp(request.param)))
        patch.setattr(native_build, "FLAGS", [*native_build.FLAGS, *flags])
        library, _, _ = native_build.build_library(f"half_linear_{request.param}",
                                                   (native_library.SOURCES[0].with_name("half_linear.c"),))
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.half_linear.argtypes = [ctypes.c_int, pointer, i64, i64, pointer, i64, pointer, pointer, ctypes.c_int]
    assert library.half_linear_supported() == supported
    return library


def variant_linear(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out_float: bool) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32 if out_float else x.dtype)
    status = library.half_linear(native_half_linear.HALF_LINEAR_DTYPES[x.dtype], x.data_ptr(), x.shape[0], x.shape[1],
                                 weight.data_ptr(), weight.shape[0], bias.data_ptr() if bias is not None else None,
                                 out.data_ptr(), int(out_float))
    assert status == 0
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_other_instruction_sets_hold_the_same_bound(variant: ctypes.CDLL, dtype: torch.dtype) -> None:
    for out_features, in_features in [(1, 1), (9, 31), (65, 97), (33, 257), (130, 1030)]:
        x, weight, bias = inputs(17, out_features, in_features, dtype, in_features, True)
        value, size = exact(x, weight, bias)
        alone = torch.cat([variant_linear(variant, row[None], weight, bias, True) for row in x])
        for rows in (1, 2, 3, 5, 17):
            summed = variant_linear(variant, x[:rows], weight, bias, True)
            assert torch.equal(summed, alone[:rows])
            assert ((summed.double() - value[:rows]).abs() <= float32_bound(size[:rows], in_features)).all()
            assert torch.equal(variant_linear(variant, x[:rows], weight, bias, False), summed.to(dtype))
    x, weight, _ = inputs(3, 20, 40, dtype, 9, False)
    x[1, 5] = float("nan")
    out = variant_linear(variant, x, weight, None, False)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
