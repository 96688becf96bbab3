"""The ``int8`` quant method: per-output-channel symmetric weight-only int8 (W8A16), quantized at load.

The checkpoint's floating-point weight is loaded as usual, then replaced by an int8 ``qweight``
``[out, in]`` and one float32 ``weight_scale`` per output row (``scale = max|row| / 127``).

Tensor parallelism: a column-parallel rank holds whole rows. A row-parallel rank holds a slice of
every row, but its scale is still that of the *whole* row: the loader sees the full checkpoint
tensor before cutting the slice and keeps ``max|row|`` then, so each rank's codes and scales are
exactly the one-rank layer's (not a coarser or finer per-slice quantization).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pluginfer.core.kernels import define_op
from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.context import quant_kernel
from pluginfer.quant.sharding import UNSPLIT, row_split
from pluginfer.quant.tiled import InSituQuantMethod, replace_weight, tiled_linear


def quantize_int8(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[out, in]``, float32 scale ``[out]``) with ``weight ~= q * scale[:, None]``.

    ``scale``: the rows' scales when ``weight`` is a slice of longer rows (a row-parallel shard).
    """
    weight = weight.float()
    if scale is None:
        scale = weight.abs().amax(dim=1) / 127
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row stays zero
    q = torch.round(weight / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


@define_op
def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for per-output-row int8 (W8A16, this method's layout): ``qweight`` int8 ``[n, k]``,
    ``weight_scale`` float32 ``[n]``. The int8 products are summed in float32 and rounded to ``x``'s dtype,
    then scaled (in float32) and rounded again, as the layer's torch path."""
    out = (x.float() @ qweight.float().t()).to(x.dtype)
    out = (out * weight_scale).to(x.dtype)
    return out if bias is None else out + bias


def _load_row_split(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Keep each whole row's ``max|row|`` (in the weight's dtype, as one rank would see it), then load the slice."""
    if loaded.dim() == 2:  # a wrong shape is left to the layer's loader to name
        # Rounding to the weight's dtype is monotonic and symmetric, so it commutes with abs and max.
        layer.int8_row_absmax = loaded.abs().amax(dim=1).to(param.dtype).float()
    layer.weight_loader(param, loaded)


class Int8Linear(InSituQuantMethod):
    name = "int8"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        super().create_weights(layer, input_size, output_size, dtype, shard)
        if row_split(shard):
            layer.weight.weight_loader = partial(_load_row_split, layer)
        layer.int8_matmul = quant_kernel("int8_matmul", self.name)  # a device kernel, if the backend has one

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in layer._parameters:
            return  # already quantized
        absmax = getattr(layer, "int8_row_absmax", None)
        q, scale = quantize_int8(layer.weight.data, None if absmax is None else absmax / 127)
        layer.int8_row_absmax = None
        replace_weight(layer, qweight=q, weight_scale=scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q = layer.qweight
        matmul = getattr(layer, "int8_matmul", None)
        if matmul is not None:
            return matmul(x, q, layer.weight_scale, bias)
        # Integers up to 127 are exact in every float dtype; the scale is applied once to the output.
        out = tiled_linear(x, q.shape[0], lambda start, stop: q[start:stop].to(x.dtype), None)
        out = (out * layer.weight_scale).to(x.dtype)
        return out if bias is None else out + bias


def build(quant_config: dict | None = None) -> Int8Linear:
    if quant_config:
        raise ValueError(f"quant method 'int8' quantizes a floating-point checkpoint while loading; "
                         f"this checkpoint is already quantized ({quant_config.get('quant_method', quant_config)})")
    return Int8Linear()
