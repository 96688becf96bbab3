"""In-situ GGML quant methods (``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q4_k``, ``q6_k``).

Each linear weight of a float checkpoint is quantized once loaded into llama.cpp's bytes (``qweight`` uint8
``[out, row_bytes]``, as a GGUF tensor of that type, sharing ``ggml_blocks.ggml_linear``). Inputs (a rank's
shard) must hold whole blocks of 32 (256 for K-quants), else refused at build or load; blocks quantize
independently, so a rank's slice gives the same bytes as on one rank.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.context import backend_op, current_context, has_context, quant_kernel
from pluginfer.quant import ggml_blocks, ggml_quantize
from pluginfer.quant.ggml_ops import MATMUL_OPS
from pluginfer.quant.sharding import UNSPLIT, check_input_split
from pluginfer.quant.tiled import InSituQuantMethod, replace_weight


class GGMLInSituLinear(InSituQuantMethod):
    """One GGML block type, quantized from the checkpoint's float weight while it loads."""

    def __init__(self, name: str, qtype: GGMLQuantizationType) -> None:
        self.name = name
        self.qtype = qtype
        self.block_size, self.type_size = GGML_QUANT_SIZES[qtype]

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        # A row-parallel rank quantizes its own slice of inputs: whole blocks, each quantized as on one rank.
        check_input_split(shard, input_size, self.block_size,
                          f"the {self.qtype.name} block of {self.block_size} inputs")
        super().create_weights(layer, input_size, output_size, dtype, shard)
        # The backend's native tile dequantization, if it has one (None: the torch path).
        layer.ggml_dequantize = backend_op(current_context().backend, "ggml_dequantize") if has_context() else None
        # A device kernel reading the blocks (the cuda backend's Q8_0 and Q4_0), if the backend has one.
        layer.ggml_matmul = quant_kernel(MATMUL_OPS.get(self.qtype), self.name)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in layer._parameters:
            return  # already quantized
        weight = layer.weight.data
        name = getattr(layer.weight, "checkpoint_name", "weight")
        if weight.shape[1] % self.block_size:
            raise ValueError(f"quant method {self.name!r} stores blocks of {self.block_size} weights along the "
                             f"input dim; {name!r} has shape {tuple(weight.shape)}, an input size that is not a "
                             f"multiple of {self.block_size}")
        replace_weight(layer, qweight=ggml_quantize.quantize(weight, self.qtype, name=name))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raw = layer.qweight
        cols = raw.shape[1] // self.type_size * self.block_size
        if getattr(layer, "ggml_matmul", None) is not None:
            return layer.ggml_matmul(x, raw, cols, bias)
        return ggml_blocks.ggml_linear(x, raw, self.qtype, cols, bias, getattr(layer, "ggml_dequantize", None))


def _build(name: str, qtype: GGMLQuantizationType, quant_config: dict | None) -> GGMLInSituLinear:
    if quant_config:
        raise ValueError(f"quant method {name!r} quantizes a floating-point checkpoint while loading; "
                         f"this checkpoint is already quantized ({quant_config.get('quant_method', quant_config)})")
    return GGMLInSituLinear(name, qtype)


def build_q8_0(quant_config: dict | None = None) -> GGMLInSituLinear:
    return _build("q8_0", GGMLQuantizationType.Q8_0, quant_config)


def build_q4_0(quant_config: dict | None = None) -> GGMLInSituLinear:
    return _build("q4_0", GGMLQuantizationType.Q4_0, quant_config)


def build_q4_1(quant_config: dict | None = None) -> GGMLInSituLinear:
    return _build("q4_1", GGMLQuantizationType.Q4_1, quant_config)


def build_q5_0(quant_config: dict | None = None) -> GGMLInSituLinear:
    return _build("q5_0", GGMLQuantizationType.Q5_0, quant_config)


def build_q5_1(quant_config: dict | None = None) -> GGMLInSituLinear:
    return _build("q5_1", GGMLQuantizationType.Q5_1, quant_config)


def build_q4_k(quant_config: dict | None = None) -> GGMLInSituLinear:
    return _build("q4_k", GGMLQuantizationType.Q4_K, quant_config)


def build_q6_k(quant_config: dict | None = None) -> GGMLInSituLinear:
    return _build("q6_k", GGMLQuantizationType.Q6_K, quant_config)
