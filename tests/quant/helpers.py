"""Build one linear layer with a registered quant method and load a dense weight as the loader does."""

from __future__ import annotations

import torch

from pluginfer.backends.cpu import backend as cpu
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext
from pluginfer.core.registry import get_registry
from pluginfer.layers.context import building
from pluginfer.layers.linear import ReplicatedLinear


def build_layer(quant: str, input_size: int, output_size: int, bias: bool = False,
                dtype: torch.dtype = torch.float32) -> ReplicatedLinear:
    method = get_registry().load("quant", quant)(None)
    ctx = BuildContext(backend=cpu.build(), quant=method, collective=single.build(), dtype=dtype, max_model_len=64)
    with building(ctx):
        return ReplicatedLinear(input_size, output_size, bias=bias)


def load_and_quantize(layer: ReplicatedLinear, weight: torch.Tensor, name: str,
                      bias: torch.Tensor | None = None) -> None:
    """What ``load_named_weights`` does for one layer: every loader, then the quant method's repacking."""
    layer.weight.checkpoint_name = name
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)
    layer.quant_method.process_weights_after_loading(layer)
