"""The ``int8`` quant method: per-output-channel symmetric weight-only int8 (W8A16), quantized at load.

The checkpoint's floating-point weight is loaded as usual, then replaced by an int8 ``qweight``
``[out, in]`` and one float32 ``weight_scale`` per output row (``scale = max|row| / 127``).
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.quant.tiled import InSituQuantMethod, replace_weight, tiled_linear


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[out, in]``, float32 scale ``[out]``) with ``weight ~= q * scale[:, None]``."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1) / 127
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row stays zero
    q = torch.round(weight / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


class Int8Linear(InSituQuantMethod):
    name = "int8"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in layer._parameters:
            return  # already quantized
        q, scale = quantize_int8(layer.weight.data)
        replace_weight(layer, qweight=q, weight_scale=scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q = layer.qweight
        # Integers up to 127 are exact in every float dtype; the scale is applied once to the output.
        out = tiled_linear(x, q.shape[0], lambda start, stop: q[start:stop].to(x.dtype), None)
        out = (out * layer.weight_scale).to(x.dtype)
        return out if bias is None else out + bias


def build(quant_config: dict | None = None) -> Int8Linear:
    if quant_config:
        raise ValueError(f"quant method 'int8' quantizes a floating-point checkpoint while loading; "
                         f"this checkpoint is already quantized ({quant_config.get('quant_method', quant_config)})")
    return Int8Linear()
