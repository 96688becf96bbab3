"""The dense weight layouts (the cpu backend's policy, backends/cpu_dense.py, reached by layers/dense.py through
the kernel table): which one a weight gets, and that each computes x W^T + b."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import amx_half, onednn
from pluginfer.backends.cpu import half_linear as native_half_linear
from pluginfer.backends.cpu import ops as native
from pluginfer.layers import dense
from tests.layers.conftest import PANELS_AVAILABLE, backend_with


@pytest.mark.parametrize(("native_kernels", "batched", "expected"), [
    (True, False, "panels"), (True, True, "panels"),
    (False, False, "transposed"), (False, True, "onednn"),
])
def test_layout_choice_and_result(native_kernels: bool, batched: bool, expected: str) -> None:
    if expected == "panels" and not PANELS_AVAILABLE:
        pytest.skip("the panel kernel needs the native library on an AVX-512 CPU")
    if expected == "onednn" and not onednn.available():
        pytest.skip("this torch build has no oneDNN")
    matmul = dense.DenseMatmul(backend_with(native_kernels), batched)
    weight, bias = torch.randn(90, 40), torch.randn(90)
    layout, placed = matmul.relayout(weight)
    assert layout == expected
    assert matmul.packed_layout(weight) == (None if expected == "transposed" else expected)
    for shape in ((1, 40), (16, 40), (3, 5, 40)):
        x = torch.randn(*shape)
        for b in (None, bias):
            torch.testing.assert_close(matmul.linear(layout, x, placed, b, 90), F.linear(x, weight, b),
                                       atol=1e-5, rtol=1e-5)


HALF_AVAILABLE = native.available() is None and native.op("half_linear") is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_keeps_out_in_for_the_native_gemv_and_is_never_packed(dtype: torch.dtype) -> None:
    """The native 16-bit GEMV reads the checkpoint's [out, in] (``half``) up to its row limit, the AMX tiles
    (where this CPU has them) or F.linear the same tensor above it; without the native kernels the weight is
    transposed for MKL as before."""
    torch.manual_seed(0)
    weight, bias = torch.randn(32, 16).to(dtype), torch.randn(32).to(dtype)
    for native_kernels in (True, False):
        matmul = dense.DenseMatmul(backend_with(native_kernels), True)
        layout, placed = matmul.relayout(weight)
        assert matmul.packed_layout(weight) is None
        if native_kernels and HALF_AVAILABLE:
            assert layout == "half" and torch.equal(placed, weight)
            limit = native_half_linear.HALF_LINEAR_MAX_ROWS[dtype]
            for rows in (1, limit):
                x = torch.randn(rows, 16).to(dtype)
                assert torch.equal(matmul.linear(layout, x, placed, bias, 32), native_half_linear.half_linear(x, weight, bias))
            x = torch.randn(limit + 1, 16).to(dtype)
            if amx_half.takes(dtype, limit + 1):
                # AMX tiles take these rows: float32 sums in another order than torch's GEMM, so another rounding
                expected = native_half_linear.half_linear(x, weight, bias)
            else:
                expected = F.linear(x, weight, bias)
            assert torch.equal(matmul.linear(layout, x, placed, bias, 32), expected)
        else:
            assert layout == "transposed" and placed.shape == (16, 32)


def test_without_backend_dense_ops_the_checkpoint_layout_stays() -> None:
    class Plain:  # a backend that offers no kernels: the table's references decide
        def op(self, name: str) -> None:
            return None

    matmul = dense.DenseMatmul(Plain(), True)
    weight, bias, x = torch.randn(8, 6), torch.randn(8), torch.randn(3, 6)
    layout, placed = matmul.relayout(weight)
    assert (layout, matmul.packed_layout(weight)) == ("checkpoint", None) and placed is weight
    torch.testing.assert_close(matmul.linear(layout, x, placed, bias, 8), F.linear(x, weight, bias))


def test_the_cpu_backend_answers_the_dense_ops_from_its_kernel_table() -> None:
    backend = backend_with(False)
    assert {"dense_layout", "dense_pack", "dense_linear"} <= set(backend.kernels.names())
    assert backend.op("dense_linear") == backend.kernels.implementation("dense_linear")


def test_a_layout_the_cpu_backend_does_not_know_is_an_error() -> None:
    matmul = dense.DenseMatmul(backend_with(False), False)
    with pytest.raises(ValueError, match="no dense layout named 'tiles'"):
        matmul.pack("tiles", torch.randn(4, 4))
