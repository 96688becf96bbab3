"""The ``awq`` quant method: AWQ GEMM checkpoints (AutoAWQ, GPTQModel ``format=gemm``).

4-bit, asymmetric, group sizes dividing the inputs: ``qweight`` ``[in, out / 8]`` and ``qzeros`` ``[groups, out / 8]``
int32 packed along the outputs in ``AWQ_ORDER``, ``scales`` ``[groups, out]``;
``W[o, i] = (q[i, o] - zero[i // group, o]) * scale[i // group, o]``. Loading repacks ``qweight`` into GPTQ's
layout so both share one tiled matmul (``packing.GroupQuantLinear``). A row-parallel rank's inputs must hold
whole groups (else a ``ValueError`` naming the tensor-parallel size and the group size).
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.protocols import ShardSpec
from pluginfer.quant.packing import AWQ_ORDER, GroupQuantLinear, dequantize_grouped, pack_int32, unpack_int32
from pluginfer.quant.sharding import UNSPLIT

AWQ_BITS = 4
REPACK_WORDS = 128  # qweight columns (8 outputs each) repacked per step


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int = AWQ_BITS
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int32 weights ``[in, out]``, int32 zero points ``[groups, out]``, scales ``[groups, out]``), values in [0, 16)."""
    if bits != AWQ_BITS:
        raise ValueError(f"quantization_config.bits: unsupported value {bits!r} for awq (supported: 4)")
    weights = unpack_int32(qweight, bits, dim=1, order=AWQ_ORDER)[:, : scales.shape[1]]
    zeros = unpack_int32(qzeros, bits, dim=1, order=AWQ_ORDER)[:, : scales.shape[1]]
    return weights, zeros, scales


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   bits: int = AWQ_BITS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``[out, in]`` weight of an AWQ GEMM checkpoint's tensors (tests and repacking only)."""
    weights, zeros, scales = unpack_awq(qweight, qzeros, scales, bits)
    group_size = weights.shape[0] if group_size == -1 else group_size
    g_idx = torch.arange(weights.shape[0], device=weights.device) // group_size
    return dequantize_grouped(weights, zeros, scales, g_idx, dtype).contiguous()


def _check_config(config: dict) -> tuple[int, int]:
    bits = config.get("bits", config.get("w_bit", AWQ_BITS))
    if bits != AWQ_BITS:
        raise ValueError(f"quantization_config.bits: unsupported value {bits!r} for awq (supported: 4)")
    group_size = config.get("group_size", config.get("q_group_size", 128))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"quantization_config.group_size: unsupported value {group_size!r} for awq "
                         f"(a positive number of inputs)")
    version = str(config.get("version", config.get("format", "gemm"))).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version: unsupported value {version!r} for awq (supported: gemm)")
    if not config.get("zero_point", True):
        raise ValueError("quantization_config.zero_point: unsupported value False for awq (supported: true)")
    for field in ("desc_act", "lm_head"):
        if config.get(field):
            raise ValueError(f"quantization_config.{field}: unsupported value {config[field]!r} for awq")
    if config.get("modules_to_not_convert"):
        raise ValueError(f"quantization_config.modules_to_not_convert: unsupported value "
                         f"{config['modules_to_not_convert']!r} (every linear layer is quantized here)")
    return bits, group_size


class AWQLinear(GroupQuantLinear):
    name = "awq"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        self._check_sizes(layer, input_size, output_size, shard)
        groups = input_size // self.group_size
        self._register(layer, "qweight", torch.zeros(input_size, output_size // self.pack, dtype=torch.int32),
                       output_dim=1, input_dim=0, packed_dim=1, packed_factor=self.pack)
        self._register(layer, "qzeros", torch.zeros(groups, output_size // self.pack, dtype=torch.int32),
                       output_dim=1, input_dim=0, packed_dim=1, packed_factor=self.pack)
        self._register(layer, "scales", torch.zeros(groups, output_size, dtype=torch.float16),
                       output_dim=1, input_dim=0)
        self._find_kernel(layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "quant_group_size", None) is not None:
            return  # already in the compute layout
        qweight, qzeros, scales = layer.qweight.data, layer.qzeros.data, layer.scales.data
        repacked = torch.empty(qweight.shape[0] // self.pack, scales.shape[1], dtype=torch.int32,
                               device=qweight.device)
        for start in range(0, qweight.shape[1], REPACK_WORDS):  # a few MB of int64 codes at a time
            stop = min(start + REPACK_WORDS, qweight.shape[1])
            codes = unpack_int32(qweight[:, start:stop], self.bits, dim=1, order=AWQ_ORDER)
            repacked[:, start * self.pack:stop * self.pack] = pack_int32(codes, self.bits, dim=0)
        zeros = pack_int32(unpack_int32(qzeros, self.bits, dim=1, order=AWQ_ORDER), self.bits, dim=1)
        self._set_layout(layer, repacked, zeros, scales, None)


def build(quant_config: dict | None = None) -> AWQLinear:
    if not quant_config:
        raise ValueError("quant method 'awq' needs the checkpoint's quantization_config (bits, group_size, ...)")
    method = quant_config.get("quant_method", "awq")
    if method != "awq":
        raise ValueError(f"quantization_config.quant_method: {method!r} is not an awq checkpoint")
    return AWQLinear(*_check_config(quant_config))


__all__ = ["AWQLinear", "build", "dequantize_awq", "unpack_awq"]
