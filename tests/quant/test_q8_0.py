"""The ``q8_0`` method against gguf-py (bit-exact with llama.cpp's C reference for Q8_0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

from pluginfer.quant.ggml_q8_0 import dequantize_q8_0, quantize_q8_0  # noqa: E402
from tests.quant.helpers import build_layer, load_and_quantize  # noqa: E402

Q8_0 = GGMLQuantizationType.Q8_0
SHAPES = [(1, 32), (7, 64), (16, 96), (33, 256), (5, 1024)]


def to_gguf_bytes(q: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Our (q, d) laid out as gguf's blocks: per block 2 bytes fp16 d, then 32 int8."""
    rows = q.shape[0]
    d = scales.numpy().view(np.uint8).reshape(rows, -1, 2)
    qs = q.numpy().view(np.uint8).reshape(rows, -1, 32)
    return np.concatenate([d, qs], axis=2).reshape(rows, -1)


def random_weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator) * torch.rand(shape[0], 1, generator=generator) * 3
    weight[0, :32] = 0  # an all-zero block: d = 0, q = 0
    if shape[1] >= 64:
        weight[0, 32:64] = torch.arange(32) - 15.5  # values landing on .5 after scaling (rounding ties)
    return weight


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_and_dequantize_are_bit_exact_with_gguf(shape: tuple[int, int], dtype: torch.dtype) -> None:
    weight = random_weight(shape, seed=shape[0] * 1000 + shape[1]).to(dtype)
    q, scales = quantize_q8_0(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.float16
    assert q.shape == shape and scales.shape == (shape[0], shape[1] // 32)
    expected = gguf_quants.quantize(weight.float().numpy(), Q8_0)
    np.testing.assert_array_equal(to_gguf_bytes(q, scales), expected)
    ours = dequantize_q8_0(q, scales)
    np.testing.assert_array_equal(ours.numpy(), gguf_quants.dequantize(expected, Q8_0))


def test_input_size_not_a_multiple_of_32_names_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*multiple of 32"):
        quantize_q8_0(torch.randn(4, 40), "model.layers.0.mlp.down_proj.weight")
    layer = build_layer("q8_0", input_size=40, output_size=8)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.o_proj\.weight'.*\(8, 40\)"):
        load_and_quantize(layer, torch.randn(8, 40), "model.layers.1.self_attn.o_proj.weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_dense_linear_of_the_dequantized_weight(dtype: torch.dtype) -> None:
    # 1100 outputs: more than two tiles of 512 rows, the last one partial.
    weight, bias = torch.randn(1100, 128) * 0.1, torch.randn(1100)
    layer = build_layer("q8_0", input_size=128, output_size=1100, bias=True, dtype=dtype)
    load_and_quantize(layer, weight.to(dtype), "w", bias.to(dtype))
    assert set(dict(layer.named_parameters())) == {"qweight", "scales", "bias"}
    x = torch.randn(3, 5, 128).to(dtype)
    expected = F.linear(x.float(), dequantize_q8_0(layer.qweight, layer.scales), bias.to(dtype).float())
    # float32: the same products summed in another order. bfloat16: the tile is rounded to
    # bfloat16 before the matmul, like any bfloat16 weight.
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(layer(x).float(), expected, **tolerance)
    # Against the original dense weight: each weight is off by at most d / 2 = max|block| / 254.
    if dtype == torch.float32:
        error_bound = (x.abs() @ (weight.abs().amax(dim=1) / 254 + 1e-6)[None, :].expand(128, -1))
        assert ((layer(x) - F.linear(x, weight, bias)).abs() <= error_bound).all()
