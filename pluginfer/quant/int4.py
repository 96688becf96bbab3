"""The ``int4`` quant method: group-wise asymmetric 4-bit weights quantized at load (W4A16).

Each 128 weights along the inputs get an fp16 ``scale = (max - min) / 15`` and ``zero = min``; levels
``q = clamp(round((w - zero) / scale), 0, 15)`` read back as ``q * scale + zero`` (a constant group: ``q = 0``).
Stored: ``qweight`` uint8 ``[out, in / 2]`` (even input in the low nibble), ``scales`` and ``zeros`` fp16
``[out, in / 128]``: 0.53 bytes per weight. Inputs (a rank's shard) not a multiple of 128 are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.kernels import define_op
from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.context import backend_op, current_context, has_context, quant_kernel
from pluginfer.quant.sharding import UNSPLIT, check_input_split
from pluginfer.quant.tiled import (
    InSituQuantMethod,
    replace_weight,
    tile_buffer,
    tile_compute_dtype,
    tile_into_buffer,
    tiled_linear,
)

GROUP_SIZE = 128


def quantize_int4(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 ``[out, in / 2]``, fp16 scales, fp16 zeros ``[out, in / 128]``); ``name`` is named in errors."""
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(f"quant method 'int4' quantizes groups of {GROUP_SIZE} weights along the input dim; "
                         f"{name!r} has shape {tuple(weight.shape)}, an input size that is not a multiple of "
                         f"{GROUP_SIZE}")
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales, zeros = ((high - low) / 15).half(), low.half()
    step = scales.float().unsqueeze(-1)
    levels = torch.where(step == 0, 0.0, (groups - zeros.float().unsqueeze(-1)) / step)
    q = torch.round(levels).clamp_(0, 15).to(torch.uint8).reshape(rows, cols // 2, 2)
    return q[..., 0] | (q[..., 1] << 4), scales, zeros


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale + zero`` in float32, then ``dtype``: ``[out, in]``."""
    rows, groups = scales.shape
    q = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(rows, groups, GROUP_SIZE)
    dense = q.float() * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)
    return dense.reshape(rows, groups * GROUP_SIZE).to(dtype)


@define_op
def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rows of this method's layout (``qweight`` uint8 ``[rows, in / 2]``, low nibble first; float16 ``scales``
    and ``zeros`` ``[rows, groups]``) as float32 ``[rows, in]``, ``q * scale + zero`` (into ``out`` when given:
    a contiguous float32 or bfloat16 tensor of at least that many elements, whose dtype the result takes).
    None from a kernel: dtypes, strides or shapes it does not take (the caller runs :func:`dequantize_int4`)."""
    dense = dequantize_int4(qweight, scales, zeros)
    if out is None:
        return dense
    return out.view(-1)[:dense.numel()].view(dense.shape).copy_(dense)


@define_op
def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``W = dequantize_int4(qweight, scales, zeros)`` rounded to ``x``'s dtype,
    products summed in float32. No backend implements it yet: one that runs quantized weights only through its
    own kernels (``quant_kernels_required``) refuses int4."""
    out = (x.float() @ dequantize_int4(qweight, scales, zeros, x.dtype).float().t()).to(x.dtype)
    return out if bias is None else out + bias


class Int4Linear(InSituQuantMethod):
    name = "int4"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        # Groups run along the inputs: a row-parallel rank's inputs must hold whole groups (then each group
        # is quantized exactly as on one rank).
        check_input_split(shard, input_size, GROUP_SIZE, f"the int4 group of {GROUP_SIZE} inputs")
        super().create_weights(layer, input_size, output_size, dtype, shard)
        # The backend's native tile dequantization, if it has one (None: the torch path).
        layer.int4_dequantize = backend_op(current_context().backend, "int4_dequantize") if has_context() else None
        quant_kernel("int4_matmul", self.name)  # no backend has one: a backend that needs one refuses int4

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in layer._parameters:
            return  # already quantized
        qweight, scales, zeros = quantize_int4(layer.weight.data, getattr(layer.weight, "checkpoint_name", "weight"))
        replace_weight(layer, qweight=qweight, scales=scales, zeros=zeros)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, scales, zeros = layer.qweight, layer.scales, layer.zeros
        kernel = getattr(layer, "int4_dequantize", None)
        dtype = tile_compute_dtype(x, kernel)  # bfloat16 where the backend's kernel asks for it
        into_buffer = tile_into_buffer(dtype, kernel)

        def tile(start: int, stop: int) -> torch.Tensor:
            if kernel is not None:
                buffer = tile_buffer((stop - start) * qweight.shape[1] * 2, dtype) if into_buffer else None
                dense = kernel(qweight[start:stop], scales[start:stop], zeros[start:stop], buffer)
                if dense is not None:
                    return dense if into_buffer else dense.to(dtype)
            return dequantize_int4(qweight[start:stop], scales[start:stop], zeros[start:stop], dtype)

        return tiled_linear(x, qweight.shape[0], tile, bias, dtype)


def build(quant_config: dict | None = None) -> Int4Linear:
    if quant_config:
        raise ValueError(f"quant method 'int4' quantizes a floating-point checkpoint while loading; "
                         f"this checkpoint is already quantized ({quant_config.get('quant_method', quant_config)})")
    return Int4Linear()
