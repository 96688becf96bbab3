"""The ``none`` quant method: a plain dense weight in the model's dtype.

On the CPU the weight is re-laid out once it has loaded, for the matmul library that reads it
fastest (docs/performance.md has the measurements, 0.5B-shaped llama, fp32, 2 cores):

- ``onednn``: oneDNN's own blocked layout (``torch.ops.mkldnn``), when the engine batches several
  sequences per step (``scheduler.max_num_seqs > 1``) and the dtype is float32. MKL's skinny GEMM
  wastes most of its time at 2-64 rows; oneDNN's prepacked kernel decodes batch 16 ~1.3x faster,
  at a ~7% cost for a lone sequence.
- ``transposed`` (``[in, out]``): otherwise. MKL's GEMV reads this layout at close to the memory
  bandwidth, the best a batch of one can do.

Both replace the checkpoint's layout: the weight is held once either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.layers import onednn
from pluginfer.layers.context import current_context


class UnquantizedLinear:
    """Dense ``weight`` of ``[output_size, input_size]``; the matmul is ``x @ W^T``."""

    name = "none"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)
        layer.weight_layout = "checkpoint"
        layer.batched = current_context().max_num_seqs > 1

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        if weight.device.type != "cpu" or layer.weight_layout != "checkpoint":
            return
        if onednn.worth_packing(weight, layer.batched):
            layer.weight = nn.Parameter(onednn.pack(weight), requires_grad=False)
            layer.weight_layout = "onednn"
        else:
            layer.weight = nn.Parameter(weight.t().contiguous(), requires_grad=False)
            layer.weight_layout = "transposed"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight_layout == "onednn":
            return onednn.linear(x, layer.weight, bias)
        if layer.weight_layout == "checkpoint":
            return F.linear(x, layer.weight, bias)
        if bias is None:
            return torch.matmul(x, layer.weight)
        return torch.addmm(bias, x, layer.weight) if x.dim() == 2 else torch.matmul(x, layer.weight) + bias


def build(quant_config: dict | None = None) -> UnquantizedLinear:
    if quant_config:
        raise ValueError(f"quant method 'none' takes no quantization_config, got {quant_config}")
    return UnquantizedLinear()
