"""The ``gptq`` quant method: GPTQ checkpoints as GPTQModel and AutoGPTQ write them.

Bits 4 and 8, any group size dividing the inputs (or -1), act-order (``g_idx``), symmetric or not; format
``gptq`` (v1) stores each zero point minus one, ``gptq_v2`` as is. Tensors: ``qweight`` int32 ``[in / pack, out]``,
``qzeros`` int32 ``[groups, out / pack]``, ``scales`` ``[groups, out]``, ``g_idx`` ``[in]``;
``W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]``. Under tensor parallelism a column-parallel
rank takes its outputs; a row-parallel rank its input rows, and with act-order every group's (small) scales
and zero points, since ``g_idx`` may send its rows to any group.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pluginfer.core.protocols import ShardSpec
from pluginfer.quant.packing import (
    GroupQuantLinear,
    dequantize_grouped,
    pack_factor,
    unpack_int32,
)
from pluginfer.quant.sharding import UNSPLIT, row_split

SUPPORTED_BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def v1_to_v2_zeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Format v1's packed ``zero - 1`` words back to the zero points: add one to every field of the word.

    The writers (GPTQModel, as its own v1 -> v2 conversion) subtract and add one per *word*, so
    a real zero of 0 borrows from the next field up; adding per field would keep that borrow.
    """
    ones = sum(1 << shift for shift in range(0, 32, bits))
    words = qzeros.to(torch.int64) + ones
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, checkpoint_format: str = "gptq"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int32 weights ``[in, out]``, int32 real zero points ``[groups, out]``, scales, g_idx ``[in]``).

    Values are in ``[0, 2**bits)``; format v1's zero points go through ``v1_to_v2_zeros``.
    A missing ``g_idx`` means contiguous groups of ``in / groups`` inputs.
    """
    if checkpoint_format == "gptq":
        qzeros = v1_to_v2_zeros(qzeros, bits)
    elif checkpoint_format != "gptq_v2":
        raise ValueError(f"checkpoint_format: unsupported value {checkpoint_format!r} (supported: gptq, gptq_v2)")
    weights = unpack_int32(qweight, bits, dim=0)
    zeros = unpack_int32(qzeros, bits, dim=1)[:, : scales.shape[1]]
    if g_idx is None:
        g_idx = torch.arange(weights.shape[0], device=weights.device) // (weights.shape[0] // scales.shape[0])
    return weights, zeros, scales, g_idx.to(torch.int32)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    bits: int, checkpoint_format: str = "gptq", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``[out, in]`` weight of a GPTQ checkpoint's tensors (tests and repacking only)."""
    weights, zeros, scales, g_idx = unpack_gptq(qweight, qzeros, scales, g_idx, bits, checkpoint_format)
    return dequantize_grouped(weights, zeros, scales, g_idx, dtype).contiguous()


def _check_config(config: dict) -> tuple[int, int, bool, bool, str]:
    bits = config.get("bits", 4)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"quantization_config.bits: unsupported value {bits!r} for gptq (supported: 4, 8)")
    group_size = config.get("group_size", 128)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"quantization_config.group_size: unsupported value {group_size!r} "
                         f"(a positive number of inputs, or -1)")
    field = "checkpoint_format" if config.get("checkpoint_format") else "format"  # older writers: format only
    checkpoint_format = config.get(field) or "gptq"
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"quantization_config.{field}: unsupported value {checkpoint_format!r} "
                         f"for gptq (supported: {', '.join(CHECKPOINT_FORMATS)})")
    if config.get("is_marlin_format"):  # AutoGPTQ's flag for Marlin-packed tensors
        raise ValueError("quantization_config.is_marlin_format: unsupported value True for gptq (use --quant marlin)")
    if config.get("pack_dtype", "int32") != "int32":
        raise ValueError(f"quantization_config.pack_dtype: unsupported value {config['pack_dtype']!r} "
                         f"(supported: int32)")
    if config.get("lm_head"):
        raise ValueError("quantization_config.lm_head: unsupported value True (the LM head is not quantized here)")
    return bits, group_size, bool(config.get("desc_act", False)), bool(config.get("sym", True)), checkpoint_format


def _load_g_idx(shard: ShardSpec, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """This rank's input rows of ``g_idx`` (row parallel) or all of it. Fused projections (q/k/v, gate/up)
    read the same inputs, so their checkpoints' g_idx must agree."""
    name = getattr(param, "checkpoint_name", "g_idx")
    if row_split(shard):
        try:
            loaded = shard.narrow(loaded, 0, param.shape[0])
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    if loaded.shape != param.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected {tuple(param.shape)}")
    if getattr(param, "loaded", False) and not torch.equal(param.data, loaded.to(param.device, param.dtype)):
        raise ValueError(f"{name}: differs from the g_idx of the projections fused with it")
    param.data.copy_(loaded)
    param.loaded = True


class GPTQLinear(GroupQuantLinear):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str) -> None:
        super().__init__(bits, group_size)
        self.desc_act, self.sym, self.checkpoint_format = desc_act, sym, checkpoint_format

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        all_groups = row_split(shard) and self.desc_act and self.group_size != -1
        self._check_sizes(layer, input_size, output_size, shard, whole_groups=not all_groups)
        if all_groups:
            # act-order, inputs split: every rank keeps every group (see the module docstring)
            full_inputs = input_size * shard.size
            if full_inputs % self.group_size:
                raise ValueError(f"{self.name}: group_size {self.group_size} does not divide the layer's "
                                 f"{full_inputs} input features")
            group_dim, groups = None, full_inputs // self.group_size
        else:
            # Group -1 has one group over all inputs: a row-split layer keeps that group's scales whole.
            group_dim = 0 if self.group_size != -1 else None
            groups = input_size // self._group_size(input_size)
        # The checkpoint group that this rank's first row of scales is (g_idx counts the checkpoint's).
        layer.gptq_first_group = shard.rank * groups if row_split(shard) and group_dim == 0 else 0
        self._register(layer, "qweight", torch.zeros(input_size // self.pack, output_size, dtype=torch.int32),
                       output_dim=1, input_dim=0, packed_dim=0, packed_factor=self.pack)
        self._register(layer, "qzeros", torch.zeros(groups, output_size // self.pack, dtype=torch.int32),
                       output_dim=1, input_dim=group_dim, packed_dim=1, packed_factor=self.pack)
        self._register(layer, "scales", torch.zeros(groups, output_size, dtype=torch.float16),
                       output_dim=1, input_dim=group_dim)
        self._register(layer, "g_idx", torch.zeros(input_size, dtype=torch.int32), output_dim=None, input_dim=0)
        layer.g_idx.weight_loader = partial(_load_g_idx, shard)
        self._find_kernel(layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "quant_group_size", None) is not None:
            return  # already in the compute layout
        qweight, qzeros, scales, g_idx = layer.qweight.data, layer.qzeros.data, layer.scales.data, layer.g_idx.data
        if self.checkpoint_format == "gptq":
            qzeros = v1_to_v2_zeros(qzeros, self.bits)
        input_size = qweight.shape[0] * self.pack
        group_size = self._group_size(input_size)
        # Groups of this layer's scales, numbered from 0 (a row-split rank without act-order holds its own).
        local = g_idx.to(torch.int64) - getattr(layer, "gptq_first_group", 0)
        if int(local.max()) >= scales.shape[0] or int(local.min()) < 0:
            name = getattr(layer.qweight, "checkpoint_name", "qweight").removesuffix(".qweight")
            raise ValueError(f"{name}.g_idx names groups outside the {scales.shape[0]} of this layer")
        first, groups = int(local.min()), input_size // group_size
        contiguous = torch.arange(input_size, device=g_idx.device) // group_size + first
        if input_size % group_size == 0 and first + groups <= scales.shape[0] and torch.equal(local, contiguous):
            # Groups in input order: keep this rank's groups only, and no g_idx.
            self._set_layout(layer, qweight, qzeros[first:first + groups], scales[first:first + groups], None)
        else:
            self._set_layout(layer, qweight, qzeros, scales, local.to(torch.int32))


def build(quant_config: dict | None = None) -> GPTQLinear:
    if not quant_config:
        raise ValueError("quant method 'gptq' needs the checkpoint's quantization_config (bits, group_size, ...)")
    method = quant_config.get("quant_method", "gptq")
    if method != "gptq":
        raise ValueError(f"quantization_config.quant_method: {method!r} is not a gptq checkpoint")
    bits, group_size, desc_act, sym, checkpoint_format = _check_config(quant_config)
    return GPTQLinear(bits, group_size, desc_act, sym, checkpoint_format)


__all__ = ["GPTQLinear", "build", "dequantize_gptq", "pack_factor", "unpack_gptq", "v1_to_v2_zeros"]
