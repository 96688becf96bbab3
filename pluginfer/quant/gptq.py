"""The ``gptq`` quant method: GPTQ checkpoints as GPTQModel and AutoGPTQ write them.

Bits 4 and 8, any group size dividing the inputs (or -1: one group per output row),
act-order (``desc_act``: ``g_idx`` assigns each input to a group), symmetric or not.
Checkpoint format ``gptq`` (v1) stores each zero point minus one, ``gptq_v2`` stores it as is.

Checkpoint tensors, for a layer of ``out x in`` weights and ``pack = 32 // bits``:
``qweight`` int32 ``[in / pack, out]`` (packed along the inputs), ``qzeros`` int32
``[groups, out / pack]`` (packed along the outputs), ``scales`` float16 ``[groups, out]``,
``g_idx`` int32 ``[in]``. ``W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]``.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pluginfer.quant.packing import (
    GroupQuantLinear,
    dequantize_grouped,
    pack_factor,
    unpack_int32,
)

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


def _load_g_idx(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Fused projections (q/k/v, gate/up) read the same inputs, so their checkpoints' g_idx must agree."""
    loaded = layer._shard(param, loaded)
    name = getattr(param, "checkpoint_name", "g_idx")
    if loaded.shape != param.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected {tuple(param.shape)}")
    if getattr(param, "loaded", False) and not torch.equal(param.data, loaded.to(param.dtype)):
        raise ValueError(f"{name}: differs from the g_idx of the projections fused with it")
    param.data.copy_(loaded)
    param.loaded = True


class GPTQLinear(GroupQuantLinear):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str) -> None:
        super().__init__(bits, group_size)
        self.desc_act, self.sym, self.checkpoint_format = desc_act, sym, checkpoint_format

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        self._check_sizes(layer, input_size, output_size)
        if self._row_split(layer) and self.desc_act and self.group_size != -1:
            raise ValueError("quantization_config.desc_act: act-order GPTQ cannot split a layer's inputs across "
                             "tensor-parallel ranks (its groups span the whole input)")
        # Group -1 has one group over all inputs: a row-split layer keeps that group's scales whole.
        group_dim = 0 if self.group_size != -1 else None
        groups = input_size // self._group_size(input_size)
        self._register(layer, "qweight", torch.zeros(input_size // self.pack, output_size, dtype=torch.int32),
                       output_dim=1, input_dim=0, packed_dim=0, packed_factor=self.pack)
        self._register(layer, "qzeros", torch.zeros(groups, output_size // self.pack, dtype=torch.int32),
                       output_dim=1, input_dim=group_dim, packed_dim=1, packed_factor=self.pack)
        self._register(layer, "scales", torch.zeros(groups, output_size, dtype=torch.float16),
                       output_dim=1, input_dim=group_dim)
        self._register(layer, "g_idx", torch.zeros(input_size, dtype=torch.int32), output_dim=None, input_dim=0)
        layer.g_idx.weight_loader = partial(_load_g_idx, layer)
        self._find_kernel(layer)

    @staticmethod
    def _row_split(layer: nn.Module) -> bool:
        return getattr(layer, "shard_dim", None) == 1 and getattr(layer, "tp_size", 1) > 1

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "quant_group_size", None) is not None:
            return  # already in the compute layout
        qweight, qzeros, scales, g_idx = layer.qweight.data, layer.qzeros.data, layer.scales.data, layer.g_idx.data
        if self.checkpoint_format == "gptq":
            qzeros = v1_to_v2_zeros(qzeros, self.bits)
        input_size = qweight.shape[0] * self.pack
        group_size = self._group_size(input_size)
        # A row-split rank holds the inputs (and groups) from its offset on; g_idx counts from the first rank's.
        first = layer.tp_rank * scales.shape[0] if self._row_split(layer) and self.group_size != -1 else 0
        contiguous = torch.arange(input_size, device=g_idx.device) // group_size + first
        if int(g_idx.max()) - first >= scales.shape[0] or int(g_idx.min()) - first < 0:
            name = getattr(layer.qweight, "checkpoint_name", "qweight").removesuffix(".qweight")
            raise ValueError(f"{name}.g_idx names groups outside the {scales.shape[0]} of this layer")
        keep_g_idx = None if torch.equal(g_idx, contiguous) else (g_idx - first).to(torch.int32)
        self._set_layout(layer, qweight, qzeros, scales, keep_g_idx)


def build(quant_config: dict | None = None) -> GPTQLinear:
    if not quant_config:
        raise ValueError("quant method 'gptq' needs the checkpoint's quantization_config (bits, group_size, ...)")
    method = quant_config.get("quant_method", "gptq")
    if method != "gptq":
        raise ValueError(f"quantization_config.quant_method: {method!r} is not a gptq checkpoint")
    bits, group_size, desc_act, sym, checkpoint_format = _check_config(quant_config)
    return GPTQLinear(bits, group_size, desc_act, sym, checkpoint_format)


__all__ = ["GPTQLinear", "build", "dequantize_gptq", "pack_factor", "unpack_gptq", "v1_to_v2_zeros"]
