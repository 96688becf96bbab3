"""The single-rank collective: one process, every operation the identity."""

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

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        raise RuntimeError("collective 'single' has no other rank to send to")

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        raise RuntimeError("collective 'single' has no other rank to receive from")

    def barrier(self) -> None:
        pass

    def new_group(self, partition: list[list[int]]) -> SingleRank:
        if partition != [[0]]:
            raise ValueError(f"collective 'single' has one rank; cannot split it into {partition}")
        return self

    def close(self) -> None:
        pass


def build(config: object = None, rank: object = None) -> SingleRank:
    world = getattr(rank, "world_size", 1)
    if world != 1:
        raise ValueError(f"parallel.collective 'single' serves one rank, got a world of {world} "
                         "(use gloo, nccl or mpi)")
    return SingleRank()
