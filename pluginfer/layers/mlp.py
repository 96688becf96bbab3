"""The gated feed-forward block: ``down(act(gate(x)) * up(x))`` with gate and up in one matmul."""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.layers.activation import gated_activation
from pluginfer.layers.context import current_context
from pluginfer.layers.linear import MergedColumnParallelLinear, RowParallelLinear


def check_tp_divisible(size: int, field: str) -> None:
    """An intermediate size split across the context's tensor-parallel ranks must split evenly."""
    tp_size = current_context().collective.world_size
    if size % tp_size:
        raise ValueError(f"config.json: {field} {size} is not divisible by the tensor-parallel size {tp_size} "
                         "(parallel.tensor_parallel_size)")


class GatedMLP(nn.Module):
    """Gate and up column-parallel, down row-parallel: each rank holds ``intermediate_size / tp_size``.

    ``size_field``: the config field ``intermediate_size`` came from, named when it does not split.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 size_field: str = "intermediate_size") -> None:
        super().__init__()
        check_tp_divisible(intermediate_size, size_field)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = gated_activation(hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))

    def forward_partial(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's share of :meth:`forward` before the row-parallel all-reduce (the bias on rank 0 only),
        for a caller that sums it with other partial results in one all-reduce (MoE shared experts)."""
        down = self.down_proj
        bias = down.bias if down.tp_rank == 0 else None
        return down.quant_method.apply(down, self.act_fn(self.gate_up_proj(hidden)), bias)
