"""The ``q8_0`` quant method: llama.cpp's Q8_0 blocks, quantized while the checkpoint loads.

Each run of 32 weights along the input dim gets one fp16 scale ``d = max|x| / 127`` and int8
``q = round(x / d)``. Quantization is bit-exact with ``gguf.quants.quantize(..., Q8_0)`` (and so
with llama.cpp's C reference); dequantization with ``gguf.quants.dequantize``. The weights stay
in this block form in memory: ``qweight`` int8 ``[out, in]`` and ``scales`` fp16 ``[out, in / 32]``.
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.quant.tiled import InSituQuantMethod, replace_weight, tiled_linear

BLOCK_SIZE = 32


def quantize_q8_0(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[out, in]``, fp16 ``[out, in / 32]``); ``name`` is the tensor named in errors."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK_SIZE:
        raise ValueError(f"q8_0 needs the input size of {name!r} to be a multiple of {BLOCK_SIZE}, "
                         f"got shape {tuple(weight.shape)}")
    blocks = weight.float().reshape(-1, BLOCK_SIZE)
    # The same float32 steps as gguf-py's Q8_0.quantize_blocks: multiply by 1/d, round half away from 0.
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    magnitude = scaled.abs()
    floored = torch.floor(magnitude)
    q = torch.sign(scaled) * (floored + torch.floor(2 * (magnitude - floored)))
    rows = weight.shape[0]
    return q.to(torch.int8).reshape(rows, -1), d.to(torch.float16).reshape(rows, -1)


def dequantize_q8_0(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * d`` in float32 (exact: an fp16 times an int8 fits float32's mantissa), then ``dtype``."""
    rows, cols = q.shape
    dense = q.float().reshape(rows, -1, BLOCK_SIZE) * scales.float().unsqueeze(-1)
    return dense.reshape(rows, cols).to(dtype)


class Q8_0Linear(InSituQuantMethod):
    name = "q8_0"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in layer._parameters:
            return  # already quantized
        name = getattr(layer.weight, "checkpoint_name", "weight")
        q, scales = quantize_q8_0(layer.weight.data, name)
        replace_weight(layer, qweight=q, scales=scales)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scales = layer.qweight, layer.scales
        return tiled_linear(x, q.shape[0],
                            lambda start, stop: dequantize_q8_0(q[start:stop], scales[start:stop], x.dtype), bias)


def build(quant_config: dict | None = None) -> Q8_0Linear:
    if quant_config:
        raise ValueError(f"quant method 'q8_0' quantizes a floating-point checkpoint while loading; "
                         f"this checkpoint is already quantized ({quant_config.get('quant_method', quant_config)})")
    return Q8_0Linear()
