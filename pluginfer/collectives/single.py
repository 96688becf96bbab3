"""The single-rank collective: tensor parallelism of size 1 (every operation is the identity)."""

from __future__ import annotations

from typing import Any

import torch


class SingleRank:
    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass


def build(config: object = None) -> SingleRank:
    size = getattr(getattr(config, "parallel", None), "tensor_parallel_size", 1)
    if size != 1:
        raise ValueError(f"parallel.collective 'single' serves tensor_parallel_size 1, got {size}")
    return SingleRank()
