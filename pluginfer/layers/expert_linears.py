"""Mixture-of-experts weights held as one linear layer per expert and projection, in the quant method's format.

A quant method whose checkpoint tensors stay in their own layout (``holds_experts``: the ``gguf`` method,
a ``.gguf`` file's GGML blocks) would lose that layout in ``FusedExperts``' stacked float weights; instead
each expert's gate/up projection (column-split, gate rows then up rows) and down projection (row-split) is an
``ExpertLinear`` built through that method, loaded through its ``weight_loader`` and run by its ``apply``.
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.protocols import QuantMethod, ShardSpec


class ExpertLinear(nn.Module):
    """``x @ W.T`` for one expert's projection: ``output_size x input_size`` on this rank, split as ``shard``."""

    def __init__(self, quant: QuantMethod, input_size: int, output_size: int, dtype: torch.dtype,
                 shard: ShardSpec) -> None:
        super().__init__()
        self.quant_method, self.input_size, self.output_size = quant, input_size, output_size
        self.tp_rank, self.tp_size = shard.rank, shard.size
        self.shard = shard
        quant.create_weights(self, input_size, output_size, dtype, shard)
        if getattr(self.weight, "weight_loader", None) is None:
            raise ValueError(f"quant method {quant.name!r} holds experts but installs no weight_loader")

    def load(self, loaded: object, shard_id: object, name: str) -> None:
        """One whole checkpoint tensor (``shard_id``: 0 gate, 1 up of a gate/up layer; None the whole)."""
        self.weight.checkpoint_name = name
        self.weight.weight_loader(self.weight, loaded, shard_id)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, None)

    @property
    def nbytes(self) -> int:
        """Bytes of whatever the quant method keeps on the layer (parameters or attributes)."""
        seen: set[int] = set()

        def count(value: object) -> int:
            if isinstance(value, torch.Tensor):
                if value.untyped_storage().data_ptr() in seen:
                    return 0
                seen.add(value.untyped_storage().data_ptr())
                return value.nbytes
            if isinstance(value, (list, tuple)):
                return sum(count(item) for item in value)
            if isinstance(value, dict):
                return sum(count(item) for item in value.values())
            return 0

        return count([*self.parameters(), *vars(self).values()])


def expert_linears(quant: QuantMethod, num_experts: int, hidden_size: int, shard_size: int, dtype: torch.dtype,
                   rank: int, world_size: int) -> list[tuple[ExpertLinear, ExpertLinear]]:
    """Each expert's (gate_up, down) layers: gate/up rows and down columns split over ``world_size`` ranks."""
    full = shard_size * world_size
    gate_up = ShardSpec(dim=0, rank=rank, size=world_size, output_sizes=(full, full))
    down = ShardSpec(dim=1, rank=rank, size=world_size, output_sizes=(hidden_size,))
    return [(ExpertLinear(quant, hidden_size, 2 * shard_size, dtype, gate_up),
             ExpertLinear(quant, shard_size, hidden_size, dtype, down)) for _ in range(num_experts)]
