"""A ``Collective`` whose ranks are threads of one process: tensor-parallel layers tested without processes.

``run_ranks(world_size, fn)`` calls ``fn(collective)`` once per rank, each in its own thread, and
returns the results in rank order; an exception on any rank is re-raised (the other ranks are
released rather than left waiting). Sums run in rank order, so results are deterministic.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch


class _Shared:
    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size, self.timeout = world_size, timeout
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[Any] = [None] * world_size
        self.mailboxes: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.mail = threading.Condition()

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a full round trip through the barrier)."""
        self.barrier.wait()
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class ThreadCollective:
    """One rank of a thread group; implements the whole ``Collective`` protocol."""

    def __init__(self, shared: _Shared, rank: int, ranks: list[int] | None = None) -> None:
        self._shared, self.rank = shared, rank
        self.world_size = shared.world_size
        self._ranks = ranks or list(range(shared.world_size))  # this group's members, as world ranks
        # operation -> [calls, bytes], as the process collectives count
        self.stats: dict[str, list[int]] = {}

    @property
    def calls(self) -> dict[str, int]:
        return {name: calls for name, (calls, _) in self.stats.items()}

    def _count(self, name: str, nbytes: int = 0) -> None:
        entry = self.stats.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._count("all_reduce", tensor.nbytes)
        parts = self._shared.exchange(self.rank, tensor.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self._count("all_gather", tensor.nbytes)
        return torch.cat(self._shared.exchange(self.rank, tensor.clone()), dim=dim)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._count("broadcast_tensor", tensor.nbytes)
        tensor.copy_(self._shared.exchange(self.rank, tensor.clone())[src])
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        obj = self._shared.exchange(self.rank, obj)[src]
        self._count("broadcast_object", _pickled_size(obj))
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._count("all_gather_object", _pickled_size(obj))
        return self._shared.exchange(self.rank, obj)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._count("send", tensor.nbytes)
        with self._shared.mail:
            self._shared.mailboxes.setdefault((self.rank, dst), []).append(tensor.clone())
            self._shared.mail.notify_all()

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._count("recv", tensor.nbytes)
        key = (src, self.rank)
        with self._shared.mail:
            if not self._shared.mail.wait_for(lambda: self._shared.mailboxes.get(key), self._shared.timeout):
                raise RuntimeError(f"rank {self.rank}: nothing received from rank {src} "
                                   f"within {self._shared.timeout} s")
            tensor.copy_(self._shared.mailboxes[key].pop(0))
        return tensor

    def barrier(self) -> None:
        self._count("barrier")
        self._shared.barrier.wait()

    def new_group(self, partition: list[list[int]]) -> ThreadCollective:
        # Every member of a group must share one _Shared: the group's lowest rank makes it.
        made = self._shared.exchange(self.rank, None)  # keep ranks in step
        del made
        mine = next(group for group in partition if self.rank in group)
        if self.rank == min(mine):
            shared = _Shared(len(mine), self._shared.timeout)
        else:
            shared = None
        everyone = self._shared.exchange(self.rank, shared)
        shared = everyone[min(mine)]
        return ThreadCollective(shared, mine.index(self.rank), [self._ranks[r] for r in mine])

    def close(self) -> None:
        pass


def _pickled_size(obj: Any) -> int:
    """What a process collective would move for ``obj`` (0 for objects that do not pickle)."""
    try:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - thread ranks can share anything; only the count is lost
        return 0


def run_ranks(world_size: int, fn: Callable[[ThreadCollective], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``fn(collective)`` on ``world_size`` thread ranks; results in rank order."""
    shared = _Shared(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def main(rank: int) -> None:
        try:
            results[rank] = fn(ThreadCollective(shared, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            shared.barrier.abort()  # release the ranks waiting on this one

    threads = [threading.Thread(target=main, args=(rank,), name=f"rank-{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
