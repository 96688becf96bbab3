"""Pieces every multi-process ``Collective`` shares (built-in and plugins): traffic counters, partition checks,
gather layout."""

from __future__ import annotations

import torch

Stats = dict[str, list[int]]
"""Per operation ``[calls, bytes]``; bytes are the payload this rank handed to (or got from) the library."""


def count(stats: Stats, name: str, nbytes: int) -> None:
    entry = stats.setdefault(name, [0, 0])
    entry[0] += 1
    entry[1] += nbytes


def check_partition(partition: list[list[int]], world_size: int) -> None:
    """Raise ValueError unless ``partition`` splits ``range(world_size)`` into ascending, disjoint groups."""
    seen = [rank for group in partition for rank in group]
    if sorted(seen) != list(range(world_size)) or any(not group for group in partition):
        raise ValueError(f"new_group: {partition} is not a partition of the ranks 0..{world_size - 1}")
    if any(group != sorted(group) for group in partition):
        raise ValueError(f"new_group: list each group's ranks in ascending order, got {partition}")


def concat_gathered(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """``[world, *shape]`` (rank order) -> the ranks' tensors concatenated along ``dim`` of ``shape``."""
    ndim = stacked.dim() - 1
    dim = dim + ndim if dim < 0 else dim
    if not 0 <= dim < ndim:
        raise IndexError(f"all_gather: dim {dim} out of range for a {ndim}-d tensor")
    shape = list(stacked.shape[1:])
    shape[dim] *= stacked.shape[0]
    return stacked.movedim(0, dim).reshape(shape)
