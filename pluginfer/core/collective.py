"""What the engine asks of a communication library plugin (kind ``collective``): the ``Collective`` protocol."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Collective(Protocol):
    """One communication library over a group of ranks. Factory: ``factory(config: EngineConfig, rank: RankInfo)``.

    The factory joins the whole world (``rank.world_size`` processes; rendezvous at
    ``rank.master_addr:master_port`` where the library needs one) within
    ``config.parallel.timeout_s`` or raises. ``rank`` and ``world_size`` are this process's place in
    *this* group; ``src`` / ``dst`` below are ranks of this group. Every call is collective (all
    members make it, in the same order) except ``send`` / ``recv``. A peer that died or a wait past
    the timeout raises ``RuntimeError``; it never hangs forever.
    """

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place where the library allows; returns the result."""

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor (same shape on every rank) along ``dim``, in rank order."""

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s (same shape and dtype everywhere); returns it."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object (e.g. a ``StepInput``) from ``src``; every rank returns it."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order."""

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point to point: hand ``tensor`` to rank ``dst`` (which calls ``recv`` with the same shape)."""

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Point to point: fill ``tensor`` with what rank ``src`` sent; returns it."""

    def barrier(self) -> None:
        """Wait until every rank arrives."""

    def new_group(self, partition: list[list[int]]) -> Collective:
        """Split into disjoint groups (lists of this group's ranks covering all of them); every rank
        calls it with the same partition and gets the group it belongs to."""

    def close(self) -> None:
        """Leave the group and release the library's resources (idempotent)."""
