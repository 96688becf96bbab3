"""The ``none`` quant method: a plain dense weight in the model's dtype.

Once the weight has loaded it moves to the layout the fastest available matmul reads
(``layers/dense.py``: the native panel kernel, oneDNN's packed layout or ``[in, out]`` on the CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.protocols import ShardSpec
from pluginfer.layers import dense
from pluginfer.layers.context import current_context
from pluginfer.quant.sharding import UNSPLIT


class UnquantizedLinear:
    """Dense ``weight`` of ``[output_size, input_size]``; the matmul is ``x @ W^T``."""

    name = "none"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        # A dense weight splits anywhere: the layer's loader cuts this rank's slice (``output_dim`` / ``input_dim``).
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)
        layer.weight_layout = "checkpoint"
        layer.dense = dense.DenseMatmul.for_context(current_context())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight_layout != "checkpoint":
            return
        layer.weight_layout, weight = layer.dense.relayout(layer.weight.data)
        if weight is not layer.weight.data:
            layer.weight = nn.Parameter(weight, requires_grad=False)

    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype, backend: object) -> None:
        """This format keeps no vocabulary tables (``QuantMethod.vocab_table``): embeddings stay dense."""
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.dense.linear(layer.weight_layout, x, layer.weight, bias, layer.output_size)


def build(quant_config: dict | None = None) -> UnquantizedLinear:
    if quant_config:
        raise ValueError(f"quant method 'none' takes no quantization_config, got {quant_config}")
    return UnquantizedLinear()


def is_unquantized(quantization_config: dict) -> bool:
    """A checkpoint without a ``quant_method`` holds plain weights."""
    return "quant_method" not in quantization_config
