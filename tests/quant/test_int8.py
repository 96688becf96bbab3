"""The ``int8`` method: per-row scales, the rounding error bound, and the tiled matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.quant.int8 import dequantize_int8, quantize_int8
from tests.quant.helpers import build_layer, load_and_quantize


def test_dequantization_error_is_at_most_half_a_step_per_row() -> None:
    weight = torch.randn(64, 200) * torch.rand(64, 1) * 4
    weight[3] = 0  # an all-zero row stays exactly zero
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    assert q.abs().amax(dim=1)[torch.arange(64) != 3].eq(127).all()  # each row's largest weight maps to +-127
    error = (dequantize_int8(q, scale) - weight).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-5) + 1e-7).all()
    assert dequantize_int8(q, scale)[3].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_dense_linear(dtype: torch.dtype) -> None:
    weight, bias = torch.randn(1100, 96) * 0.1, torch.randn(1100)  # three tiles of rows, the last partial
    layer = build_layer("int8", input_size=96, output_size=1100, bias=True, dtype=dtype)
    load_and_quantize(layer, weight.to(dtype), "w", bias.to(dtype))
    assert set(dict(layer.named_parameters())) == {"qweight", "weight_scale", "bias"}
    x = torch.randn(2, 7, 96).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 7, 1100)
    expected = F.linear(x.float(), dequantize_int8(layer.qweight, layer.weight_scale), bias.to(dtype).float())
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    if dtype == torch.float32:
        # Against the original weight: |y - y_dense| <= sum_k |x_k| * scale / 2 for each output.
        bound = x.abs().sum(dim=-1, keepdim=True) * (layer.weight_scale / 2) + 1e-4
        assert ((out - F.linear(x, weight, bias)).abs() <= bound).all()
