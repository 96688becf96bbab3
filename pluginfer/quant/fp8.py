"""The ``fp8`` quant method: block-wise FP8 checkpoints (``quant_method: fp8``, ``weight_block_size``), as
DeepSeek-V3/R1 and Qwen3's ``-FP8`` models ship.

Each linear's ``weight`` is float8 e4m3 ``[out, in]`` with ``weight_scale_inv`` float32, one per block of
``weight_block_size`` (``[ceil(out / bn), ceil(in / bk)]``): ``W = level * scale`` blockwise. The weights are
dequantized once at load to the model's dtype and served as dense weights (the ``none`` method's layouts and
kernels), as transformers does on a CPU (``dequantize``) and vLLM where a device has no FP8 GEMM: activations
stay in the model's dtype (``activation_scheme: dynamic``'s per-token quantization of the activations is not
done; it would only move the logits away from the dequantized model's).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pluginfer.core.protocols import ShardSpec
from pluginfer.quant.sharding import UNSPLIT
from pluginfer.quant.unquantized import UnquantizedLinear


class BlockFP8Linear(UnquantizedLinear):
    """float8 levels and block scales while loading; a dense weight of the model's dtype after."""

    name = "fp8"

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        bn, bk = self.block
        if input_size % bk:
            raise ValueError(f"quantization_config.weight_block_size {list(self.block)}: a layer's {input_size} "
                             f"inputs (this rank's) are not whole blocks of {bk}")
        super().create_weights(layer, input_size, output_size, dtype, shard)
        levels = nn.Parameter(torch.zeros(output_size, input_size, dtype=torch.float8_e4m3fn), requires_grad=False)
        levels.output_dim, levels.input_dim = 0, 1
        levels.weight_loader = partial(_load_levels, layer)
        layer.register_parameter("weight", levels)
        # a scale per output row (each block row repeated at load) and input block: rows split like the weight's
        scale = nn.Parameter(torch.zeros(output_size, input_size // bk, dtype=torch.float32), requires_grad=False)
        scale.output_dim, scale.input_dim = 0, 1
        scale.weight_loader = partial(_load_scales, layer, bn)
        layer.register_parameter("weight_scale_inv", scale)
        layer.fp8_dtype = dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight_scale_inv" not in layer._parameters:
            return  # already dequantized
        scale = layer.weight_scale_inv.data.repeat_interleave(self.block[1], dim=1)
        weight = (layer.weight.data.float() * scale).to(layer.fp8_dtype)
        del layer.weight_scale_inv
        layer.weight = nn.Parameter(weight, requires_grad=False)
        super().process_weights_after_loading(layer)


def _load_levels(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if loaded.dtype != torch.float8_e4m3fn:
        raise ValueError(f"is {loaded.dtype}, not the float8_e4m3fn of an fp8 checkpoint's linear weight")
    layer.weight_loader(param, loaded) if shard_id is None else layer.weight_loader(param, loaded, shard_id)


def _load_scales(layer: nn.Module, rows: int, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: object = None) -> None:
    """A checkpoint's block scales ``[out / rows, in / bk]`` as one row per output row, for the layer's loader
    (which cuts this rank's rows and places a fused projection's)."""
    expanded = loaded.float().repeat_interleave(rows, dim=0)
    layer.weight_loader(param, expanded) if shard_id is None else layer.weight_loader(param, expanded, shard_id)


def build(quant_config: dict | None = None) -> BlockFP8Linear:
    if not quant_config:
        raise ValueError("quant method 'fp8' reads an FP8 checkpoint's quantization_config (quant_method: fp8, "
                         "weight_block_size); this checkpoint has none")
    block = quant_config.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size: {block!r}: only block-wise FP8 ([rows, inputs] "
                         f"of a block) is supported, not per-tensor scales")
    for field, allowed in (("fmt", ("e4m3", None)), ("activation_scheme", ("dynamic", None))):
        if quant_config.get(field) not in allowed:
            raise ValueError(f"quantization_config.{field}: {quant_config[field]!r} is not supported (supported: "
                             f"{allowed[0]})")
    unknown = sorted(set(quant_config) - {"quant_method", "weight_block_size", "fmt", "activation_scheme"})
    if unknown:
        raise ValueError(f"quantization_config: {', '.join(unknown)} not supported by the fp8 method")
    return BlockFP8Linear((block[0], block[1]))
