"""The ``none`` quant method: a plain dense weight in the model's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class UnquantizedLinear:
    """Dense ``weight`` of ``[output_size, input_size]``; the matmul is ``x @ W^T``.

    On the CPU the weight is stored transposed after loading: MKL's GEMM reads ``[in, out]``
    faster for the small row counts of decode (docs/performance.md has the measurement).
    """

    name = "none"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)
        layer.weight_transposed = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.device.type == "cpu" and not layer.weight_transposed:
            layer.weight = nn.Parameter(layer.weight.data.t().contiguous(), requires_grad=False)
            layer.weight_transposed = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not layer.weight_transposed:
            return F.linear(x, layer.weight, bias)
        if bias is None:
            return torch.matmul(x, layer.weight)
        return torch.addmm(bias, x, layer.weight) if x.dim() == 2 else torch.matmul(x, layer.weight) + bias


def build(quant_config: dict | None = None) -> UnquantizedLinear:
    if quant_config:
        raise ValueError(f"quant method 'none' takes no quantization_config, got {quant_config}")
    return UnquantizedLinear()
