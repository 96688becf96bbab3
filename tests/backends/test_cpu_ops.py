"""The cpu backend's native kernels against the torch references of the ops they implement (``backends/cpu/ops.py``).

The dequantizations are bit-exact with their references (the same float32 operations); the matmuls equal theirs
up to the order of float32 sums.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pluginfer.backends.cpu import ops
from pluginfer.core import kernels
from pluginfer.layers import ops as layer_ops
from pluginfer.quant import ggml_ops, ggml_quantize, int4, packing

pytestmark = pytest.mark.skipif(ops.available() is not None, reason="native kernels unavailable here")


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_ggml_dequantize_equals_its_reference(qtype: T) -> None:
    raw = ggml_quantize.quantize(_weight(6, 512, 0), qtype)
    expected = ggml_ops.ggml_dequantize(raw, int(qtype), 512)
    assert torch.equal(ops.NATIVE["ggml_dequantize"](raw, int(qtype), 512), expected)
    out = torch.empty(6 * 512, dtype=torch.bfloat16)
    assert torch.equal(ops.NATIVE["ggml_dequantize"](raw, int(qtype), 512, out),
                       ggml_ops.ggml_dequantize(raw, int(qtype), 512, torch.empty(6 * 512, dtype=torch.bfloat16)))


def test_ggml_quant_matmul_equals_its_reference() -> None:
    raw = ggml_quantize.quantize(_weight(64, 256, 1), T.Q8_0)
    x = _weight(3, 256, 2)
    ours = ops.NATIVE["ggml_quant_matmul"](x, raw, int(T.Q8_0), 256)
    if ours is None:
        pytest.skip("no fused int8 kernel for this CPU")
    torch.testing.assert_close(ours, ggml_ops.ggml_quant_matmul(x, raw, int(T.Q8_0), 256), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("act_order", [False, True])
def test_grouped_dequantize_equals_its_reference(act_order: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    in_features, out_features, group = 256, 64, 64
    codes = torch.randint(0, 16, (in_features, out_features), generator=generator)
    qweight = packing.pack_int32(codes, 4, dim=0)
    zeros = packing.pack_int32(torch.randint(0, 16, (in_features // group, out_features), generator=generator), 4, dim=1)
    scales = torch.rand(in_features // group, out_features, generator=generator).half()
    g_idx = (torch.randperm(in_features, generator=generator) // group).int() if act_order else None
    native = ops.NATIVE["grouped_dequantize"](qweight, zeros, scales, g_idx, 4, 8, 40)
    assert torch.equal(native, packing.grouped_dequantize(qweight, zeros, scales, g_idx, 4, 8, 40))


def test_int4_dequantize_equals_its_reference() -> None:
    qweight, scales, zeros = int4.quantize_int4(_weight(8, 256, 4))
    assert torch.equal(ops.NATIVE["int4_dequantize"](qweight, scales, zeros), int4.int4_dequantize(qweight, scales, zeros))


def test_panel_ops_equal_their_references() -> None:
    if ops.op("panel_linear") is None:
        pytest.skip("the panel GEMM needs AVX-512")
    weight, x, bias = _weight(70, 48, 5), _weight(5, 48, 6), _weight(1, 70, 7)[0]
    packed = ops.NATIVE["pack_panels"](weight)
    assert torch.equal(packed, kernels.lookup("pack_panels").reference(weight))
    torch.testing.assert_close(ops.NATIVE["panel_linear"](x, packed, 70, bias), ops.panel_linear(x, packed, 70, bias),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_half_linear_equals_its_reference(x_dtype: torch.dtype) -> None:
    if ops.op("half_linear") is None:
        pytest.skip("no 16-bit GEMV for this CPU")
    weight, x = _weight(40, 64, 8).to(torch.bfloat16), _weight(2, 64, 9).to(x_dtype)
    ours = ops.NATIVE["half_linear"](x, weight, None)
    expected = layer_ops.half_linear(x, weight, None)
    assert ours.dtype == expected.dtype == x_dtype
    torch.testing.assert_close(ours, expected, **(dict(atol=1e-5, rtol=1e-5) if x_dtype == torch.float32 else {}))
