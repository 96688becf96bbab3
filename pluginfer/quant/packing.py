"""Integers packed into int32 words, and the group-quantized linear layer GPTQ and AWQ share.

A word holds ``32 // bits`` values, the first at the lowest bits. AWQ interleaves them: its
slot ``i`` holds value ``AWQ_ORDER[i]`` of the eight a word covers. After loading both formats
keep one layout, GPTQ's: ``qweight`` int32 ``[in / pack, out]`` (packed along the inputs),
``qzeros`` int32 ``[groups, out / pack]`` holding the real zero points (packed along the
outputs), ``scales`` ``[groups, out]`` in the checkpoint's float type, and, for act-order
checkpoints only, ``g_idx`` int32 ``[in]``. The Marlin method repacks from this layout. ``apply`` dequantizes a few hundred output columns
at a time (``tiled.tiled_linear``), so no dense copy of a layer's weight is ever resident.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pluginfer.core.kernels import define_op
from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.context import backend_op, current_context, has_context, quant_kernel
from pluginfer.quant.sharding import column_split, row_split, split_error
from pluginfer.quant.tiled import tile_buffer, tile_compute_dtype, tile_into_buffer, tiled_linear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_factor(bits: int) -> int:
    return 32 // bits


def _inverse(order: tuple[int, ...]) -> list[int]:
    inverse = [0] * len(order)
    for slot, value in enumerate(order):
        inverse[value] = slot
    return inverse


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 values in ``[0, 2**bits)``: ``packed`` with ``dim`` grown ``32 // bits`` times (contiguous)."""
    factor = pack_factor(bits)
    dim = dim % packed.dim()
    shape = [1] * (packed.dim() + 1)
    shape[dim + 1] = factor
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device).view(shape)
    values = (packed.to(torch.int32).unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)  # the mask undoes sign extension
    if order is not None:
        values = values.index_select(dim + 1, torch.tensor(_inverse(order), device=packed.device))
    return values.flatten(dim, dim + 1)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of ``unpack_int32``: values in ``[0, 2**bits)`` packed ``32 // bits`` per int32 along ``dim``."""
    factor = pack_factor(bits)
    dim = dim % values.dim()
    if values.shape[dim] % factor:
        raise ValueError(f"cannot pack {values.shape[dim]} values {factor} to a word")
    wide = values.to(torch.int64)
    if (wide < 0).any() or (wide >> bits).any():
        raise ValueError(f"values to pack do not fit in {bits} bits")
    grouped = wide.unflatten(dim, (-1, factor))
    if order is not None:
        grouped = grouped.index_select(dim + 1, torch.tensor(order, device=values.device))
    shape = [1] * grouped.dim()
    shape[dim + 1] = factor
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device).view(shape)
    words = (grouped << shifts).sum(dim + 1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32
    return words.to(torch.int32)


def dequantize_grouped(weights: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W[out, in] = (q[in, out] - zeros[g, out]) * scales[g, out]`` with ``g = g_idx[in]``, transposed.

    Computed in float32, where ``(q - z) * s`` is exact for a float16 or bfloat16 scale (at most
    9 + 11 significant bits), then rounded once to ``dtype``: float16 gives the float16 product.
    """
    g = g_idx.long()
    return ((weights - zeros[g]).float() * scales[g].float()).to(dtype).t()


@define_op
def grouped_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                       bits: int, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Output columns ``start:stop`` (multiples of the pack) of the layout above as float32 ``[in, stop - start]``
    (into ``out`` when given, a contiguous float32 or bfloat16 tensor of at least that many elements, whose
    dtype the result takes): ``(q - zero) * scale`` in float32, where it is exact, rounded once. None from a
    kernel: bits, dtypes or strides it does not take (the caller runs its torch path)."""
    pack = 32 // bits
    weights = unpack_int32(qweight[:, start:stop], bits, dim=0)  # [in, rows]
    zeros = unpack_int32(qzeros[:, start // pack:stop // pack], bits, dim=1)
    groups = (g_idx.long() if g_idx is not None
              else torch.arange(weights.shape[0]) // (weights.shape[0] // scales.shape[0]))
    dense = (weights - zeros[groups]).float() * scales[:, start:stop].float()[groups]
    if out is None:
        return dense
    return out.view(-1)[:dense.numel()].view(dense.shape).copy_(dense)


@define_op
def grouped_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor | None, bits: int, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for GPTQ's packing (AWQ repacked into it): ``x`` ``[..., k]``, ``bits`` 4 or 8.

    ``qweight`` int32 ``[k * bits / 32, n]`` (packed along the inputs, lowest bits first); ``qzeros`` int32
    ``[groups, n * bits / 32]`` (the real zero points, packed along the outputs); ``scales`` ``[groups, n]``;
    ``g_idx`` int32 ``[k]``: each input's group (act-order), None for ``k // group_size``.
    ``W[o, i] = (q[i, o] - zero[g, o]) * scale[g, o]`` in float32, rounded to ``x``'s dtype, products
    summed in float32.
    """
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, device=x.device, dtype=torch.int32)
    codes = ((qweight[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, qweight.shape[1])  # [k, n]
    zeros = ((qzeros[:, :, None] >> shifts[None, None, :]) & mask).reshape(qzeros.shape[0], -1)[:, :scales.shape[1]]
    groups = g_idx.long() if g_idx is not None else torch.arange(codes.shape[0], device=x.device) // group_size
    weight = ((codes - zeros[groups]).float() * scales.float()[groups]).to(x.dtype)  # [k, n]
    out = (x.reshape(-1, codes.shape[0]).float() @ weight.float()).to(x.dtype)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], -1)


def _load_in_checkpoint_dtype(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                              shard_id: object = None) -> None:
    """Scales keep the checkpoint's float type (float16 as GPTQModel writes them, or bfloat16): never rounded."""
    if loaded.is_floating_point() and loaded.dtype != param.dtype:
        param.data = param.data.to(loaded.dtype)
    if shard_id is None:
        layer.weight_loader(param, loaded)
    else:
        layer.weight_loader(param, loaded, shard_id)


class GroupQuantLinear:
    """The QuantMethod base of GPTQ and AWQ: checkpoint parameters in, GPTQ layout after loading."""

    name = "group-quantized"

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size
        self.pack = pack_factor(bits)

    def _group_size(self, input_size: int) -> int:
        """Inputs per group on this rank; -1 (one group per output) keeps a row-split layer's group whole."""
        return input_size if self.group_size == -1 else self.group_size

    @staticmethod
    def _find_kernel(layer: nn.Module) -> None:
        """The backend's native tile dequantization, if it has one (None: the torch path)."""
        layer.grouped_dequantize = (backend_op(current_context().backend, "grouped_dequantize")
                                    if has_context() else None)
        layer.grouped_matmul = quant_kernel("grouped_matmul", "GPTQ/AWQ packing")  # a device kernel, if any

    def _check_sizes(self, layer: nn.Module, input_size: int, output_size: int, shard: ShardSpec,
                     whole_groups: bool = True) -> None:
        """This rank's shard must hold whole int32 words and (``whole_groups``) whole groups of inputs."""
        if row_split(shard) and input_size % self.pack:
            raise split_error(shard, input_size, f"the {self.pack} {self.bits}-bit inputs of a packed int32 word")
        if column_split(shard) and output_size % self.pack:
            raise split_error(shard, output_size, f"the {self.pack} {self.bits}-bit outputs of a packed int32 word",
                              axis="output")
        if input_size % self.pack or output_size % self.pack:
            raise ValueError(f"{self.name}: a {output_size}x{input_size} weight (this rank's shard) does not "
                             f"split into {self.pack} {self.bits}-bit values per int32 word")
        if whole_groups and self.group_size != -1 and input_size % self.group_size:
            if row_split(shard) and (input_size * shard.size) % self.group_size == 0:
                raise split_error(shard, input_size, f"quantization_config.group_size {self.group_size}")
            raise ValueError(f"{self.name}: group_size {self.group_size} does not divide this rank's "
                             f"{input_size} input features")

    @staticmethod
    def _register(layer: nn.Module, name: str, tensor: torch.Tensor, output_dim: int | None,
                  input_dim: int | None, packed_dim: int | None = None, packed_factor: int = 1) -> None:
        param = nn.Parameter(tensor, requires_grad=False)
        param.output_dim, param.input_dim = output_dim, input_dim
        if packed_dim is not None:
            # the linear layers divide offsets along this axis by the factor
            param.packed_dim, param.packed_factor = packed_dim, packed_factor
        if tensor.is_floating_point():
            param.weight_loader = partial(_load_in_checkpoint_dtype, layer)
        layer.register_parameter(name, param)

    def _set_layout(self, layer: nn.Module, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None) -> None:
        """Replace the checkpoint parameters by the layout ``apply`` reads (see the module docstring)."""
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if name in layer._parameters:
                delattr(layer, name)
        for name, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
            if tensor is not None:
                layer.register_parameter(name, nn.Parameter(tensor.contiguous(), requires_grad=False))
        layer.quant_group_size = self._group_size(qweight.shape[0] * self.pack)

    def dequantize_columns(self, layer: nn.Module, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """``W[start:stop]`` (``[rows, in]``, a transposed view) in ``dtype``; bounds are multiples of the pack."""
        rows = stop - start
        weights = unpack_int32(layer.qweight[:, start:stop], self.bits, dim=0).float()  # [in, rows]
        zeros = unpack_int32(layer.qzeros[:, start // self.pack:stop // self.pack], self.bits, dim=1).float()
        scales = layer.scales[:, start:stop].float()  # zeros and scales: [groups, rows]
        g_idx = getattr(layer, "g_idx", None)
        if g_idx is not None:
            index = g_idx.long()
            dense = weights.sub_(zeros[index]).mul_(scales[index])
        else:  # (q - z) * s is exact in float32 (see dequantize_grouped)
            groups = zeros.shape[0]
            dense = weights.view(groups, -1, rows).sub_(zeros[:, None]).mul_(scales[:, None]).view(-1, rows)
        return (dense if dtype == torch.float32 else dense.to(dtype)).t()

    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype, backend: object) -> None:
        """This format keeps no vocabulary tables (``QuantMethod.vocab_table``): embeddings stay dense."""
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        matmul = getattr(layer, "grouped_matmul", None)
        if matmul is not None:
            return matmul(x, layer.qweight, layer.qzeros, layer.scales, getattr(layer, "g_idx", None), self.bits,
                          layer.quant_group_size, bias)
        kernel = getattr(layer, "grouped_dequantize", None)
        if kernel is None:
            return tiled_linear(x, layer.qweight.shape[1],
                                lambda start, stop: self.dequantize_columns(layer, start, stop, x.dtype), bias)
        dtype = tile_compute_dtype(x, kernel)  # bfloat16 where the backend's kernel asks for it
        into_buffer = tile_into_buffer(dtype, kernel)
        g_idx = getattr(layer, "g_idx", None)

        def tile(start: int, stop: int) -> torch.Tensor:
            buffer = tile_buffer((stop - start) * layer.qweight.shape[0] * self.pack, dtype) if into_buffer else None
            dense = kernel(layer.qweight, layer.qzeros, layer.scales, g_idx, self.bits, start, stop, buffer)
            if dense is None:
                return self.dequantize_columns(layer, start, stop, dtype)
            return (dense if into_buffer else dense.to(dtype)).t()

        return tiled_linear(x, layer.qweight.shape[1], tile, bias, dtype)
