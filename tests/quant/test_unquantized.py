"""The ``none`` quant method re-lays the CPU weight out for the batch sizes the engine runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import onednn
from pluginfer.backends.cpu import ops as native
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.context import building
from pluginfer.layers.linear import ReplicatedLinear
from pluginfer.quant import unquantized
from tests.layers.conftest import PANELS_AVAILABLE, backend_with


def build(max_num_seqs: int, dtype: torch.dtype = torch.float32, bias: bool = True,
          native_kernels: bool = True) -> ReplicatedLinear:
    ctx = BuildContext(backend=backend_with(native_kernels), quant=unquantized.build(), collective=single.build(), dtype=dtype,
                       max_model_len=64, max_num_seqs=max_num_seqs)
    with building(ctx):
        return ReplicatedLinear(96, 80, bias=bias)


def load(layer: ReplicatedLinear, weight: torch.Tensor, bias: torch.Tensor) -> None:
    layer.weight.weight_loader(layer.weight, weight)
    layer.bias.weight_loader(layer.bias, bias)
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize(("max_num_seqs", "native_kernels", "layout"), [
    (1, True, "panels"), (16, True, "panels"), (1, False, "transposed"), (16, False, "onednn")])
def test_layout_follows_the_kernels_and_the_batch_and_computes_the_same(max_num_seqs: int, native_kernels: bool,
                                                                         layout: str) -> None:
    if layout == "onednn" and not onednn.available():
        pytest.skip("this torch build has no oneDNN")
    if layout == "panels" and not PANELS_AVAILABLE:
        pytest.skip("the panel kernel needs the native library on an AVX-512 CPU")
    torch.manual_seed(0)
    weight, bias = torch.randn(80, 96), torch.randn(80)
    layer = build(max_num_seqs, native_kernels=native_kernels)
    load(layer, weight, bias)
    assert layer.weight_layout == layout
    for rows in (1, 3, 16, 70):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    x = torch.randn(2, 5, 96)  # leading dims are kept
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    layer.quant_method.process_weights_after_loading(layer)  # a second call keeps the layout
    assert layer.weight_layout == layout


@pytest.mark.parametrize("native_kernels", [True, False])
def test_half_precision_keeps_out_in_for_the_native_gemv_else_transposed(native_kernels: bool) -> None:
    """The packed layouts are float32 only; bf16 weights stay ``[out, in]`` for the native 16-bit GEMV
    (``half``) where it runs, else go ``[in, out]`` for torch's matmul."""
    torch.manual_seed(0)
    weight, bias = torch.randn(80, 96), torch.randn(80)
    layer = build(16, native_kernels=native_kernels, dtype=torch.bfloat16)
    load(layer, weight.bfloat16(), bias.bfloat16())
    half = native_kernels and native.available() is None and native.op("half_linear") is not None
    assert layer.weight_layout == ("half" if half else "transposed")
    for rows in (1, 4, 16):  # both sides of the GEMV's row limit
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        torch.testing.assert_close(layer(x), F.linear(x, weight.bfloat16(), bias.bfloat16()), atol=0.1, rtol=0.02)
