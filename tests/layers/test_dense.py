"""The dense weight layouts (layers/dense.py): which one a weight gets, and that each computes x W^T + b."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.layers import dense, onednn
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


def test_half_precision_is_never_packed() -> None:
    weight = torch.randn(32, 16).bfloat16()
    for native_kernels in (True, False):
        matmul = dense.DenseMatmul(backend_with(native_kernels), True)
        layout, placed = matmul.relayout(weight)
        assert layout == "transposed" and placed.shape == (16, 32)
        assert matmul.packed_layout(weight) is None


def test_without_a_backend_op_there_are_no_panels() -> None:
    class Plain:  # a backend that offers no kernels
        def op(self, name: str) -> None:
            return None

    matmul = dense.DenseMatmul(Plain(), False)
    assert not matmul.panels
    assert matmul.relayout(torch.randn(8, 8))[0] == "transposed"
