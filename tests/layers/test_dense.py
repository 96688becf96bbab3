"""The dense weight layouts (layers/dense.py): which one a weight gets, and that each computes x W^T + b."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends import cpu, native
from pluginfer.layers import dense, onednn

PANELS = native.available() is None and native.op("panel_linear") is not None


def kernels(native_kernels: bool) -> dense.DenseKernels:
    backend = cpu.build()
    backend.native_kernels = backend.native_kernels and native_kernels
    return dense.DenseKernels(backend)


@pytest.mark.parametrize(("native_kernels", "batched", "expected"), [
    (True, False, "panels"), (True, True, "panels"),
    (False, False, "transposed"), (False, True, "onednn"),
])
def test_layout_choice_and_result(native_kernels: bool, batched: bool, expected: str) -> None:
    if expected == "panels" and not PANELS:
        pytest.skip("the panel kernel needs the native library on an AVX-512 CPU")
    if expected == "onednn" and not onednn.available():
        pytest.skip("this torch build has no oneDNN")
    ops = kernels(native_kernels)
    weight, bias = torch.randn(90, 40), torch.randn(90)
    layout, placed = dense.relayout(weight, batched, ops)
    assert layout == expected
    assert dense.packed_layout(weight, batched, ops) == (None if expected == "transposed" else expected)
    for shape in ((1, 40), (16, 40), (3, 5, 40)):
        x = torch.randn(*shape)
        for b in (None, bias):
            torch.testing.assert_close(dense.linear(layout, x, placed, b, 90, ops), F.linear(x, weight, b),
                                       atol=1e-5, rtol=1e-5)


def test_half_precision_is_never_packed() -> None:
    weight = torch.randn(32, 16).bfloat16()
    for native_kernels in (True, False):
        layout, placed = dense.relayout(weight, True, kernels(native_kernels))
        assert layout == "transposed" and placed.shape == (16, 32)
        assert dense.packed_layout(weight, True, kernels(native_kernels)) is None


def test_without_a_backend_op_there_are_no_panels() -> None:
    class Plain:  # a backend that offers no kernels
        pass

    ops = dense.DenseKernels(Plain())
    assert not ops.panels
    assert dense.relayout(torch.randn(8, 8), False, ops)[0] == "transposed"
