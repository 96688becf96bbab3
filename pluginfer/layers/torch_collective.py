"""``Collective`` over a ``torch.distributed`` process group, for any library registered with torch.distributed.

The built-in ``gloo`` and ``nccl`` plugins (``pluginfer/collectives/torch_distributed.py``) and out-of-tree
ones (the gcu plugin's ``eccl``) build on it: ``join(library, config, rank, device)`` makes the world,
``new_group`` the subgroups. It lives in ``pluginfer.layers`` because plugins import the core and the layers, never each
other.

Rendezvous. With ``rank.launcher == "torchrun"`` the store comes from ``env://`` (torchrun sets
``MASTER_ADDR``/``MASTER_PORT``; under its elastic agent every rank is a client of the agent's store).
Otherwise rank 0 opens a ``TCPStore`` at ``tcp://{master_addr}:{master_port}`` and the others connect
to it; the port must be a real one when there is more than one rank (the spawn launcher picks a free
port for everyone before it starts the ranks). Every rank then counts itself in and waits until all
``world_size`` ranks have arrived, for at most ``config.parallel.timeout_s``; past that it raises
``RuntimeError`` naming the address and how many ranks arrived. The same timeout bounds every
collective call afterwards: a peer that died raises at once (gloo sees the closed connection), a peer
that stopped answering raises after the timeout.

Traffic: ``stats`` maps each operation to ``[calls, bytes]``, the bytes being the payload this rank
handed to the library (the input of ``all_reduce``/``all_gather``/``send``, the broadcast tensor, the
pickled object). Each collective (world or subgroup) counts its own calls.
"""

from __future__ import annotations

import os
import pickle
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pluginfer.layers.collective_common import Stats, check_partition, concat_gathered, count

if TYPE_CHECKING:
    from pluginfer.core.config import EngineConfig
    from pluginfer.core.protocols import RankInfo

_HALF = (torch.bfloat16, torch.float16)
_UNSUPPORTED_DTYPE = re.compile(r"(unsupported|invalid|not supported).*(dtype|scalar ?type|data ?type)",
                                re.IGNORECASE | re.DOTALL)


class TorchDistributedCollective:
    """One process group of ``torch.distributed`` (the world, or a group made by ``new_group``)."""

    def __init__(self, backend: str, device: torch.device, timeout: timedelta,
                 group: Any = None, ranks: list[int] | None = None, store: Any = None,
                 gather_into_tensor: bool = False, bind_device: bool = False) -> None:
        """``gather_into_tensor``: the library has ``all_gather_into_tensor`` (NCCL-like device libraries);
        ``bind_device``: it takes the device at init and in ``barrier`` (NCCL)."""
        self.backend, self.device, self._timeout = backend, device, timeout
        self.gather_into_tensor, self.bind_device = gather_into_tensor, bind_device
        self._group = group  # None: the default (world) group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._ranks = ranks if ranks is not None else list(range(self.world_size))  # group rank -> global
        self._store = store  # keeps rank 0's rendezvous server alive as long as the world
        self.rendezvous_port: int | None = getattr(store, "port", None)
        self.stats: Stats = {}
        self._upcast: set[torch.dtype] = set()  # half dtypes the backend cannot sum: summed in float32
        self._closed = False

    # -- tensors -----------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if work.dtype in self._upcast:
            wide = work.to(torch.float32)
            self._all_reduce(wide)
            work.copy_(wide)
        else:
            try:
                self._all_reduce(work)
            except RuntimeError as exc:  # raised locally, before any traffic, on every rank alike
                if work.dtype not in _HALF or not _UNSUPPORTED_DTYPE.search(str(exc)):
                    raise
                self._upcast.add(work.dtype)
                return self.all_reduce(tensor)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self._group)
        count(self.stats, "all_reduce", tensor.nbytes)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        tensor = tensor.contiguous()
        count(self.stats, "all_gather", tensor.nbytes)
        stacked = tensor.new_empty((self.world_size, *tensor.shape))
        if self.gather_into_tensor:  # into the ranks' tensors concatenated along dim 0: the form every library takes
            output = stacked.view(-1, *tensor.shape[1:]) if tensor.dim() else stacked
            dist.all_gather_into_tensor(output, tensor, group=self._group)
        else:  # the slices of ``stacked`` are contiguous: gloo writes straight into it
            dist.all_gather(list(stacked.unbind(0)), tensor, group=self._group)
        return concat_gathered(stacked, dim)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        count(self.stats, "broadcast_tensor", work.nbytes)
        dist.broadcast(work, src=self._global(src), group=self._group)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        count(self.stats, "send", tensor.nbytes)
        dist.send(tensor, dst=self._global(dst), group=self._group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        count(self.stats, "recv", work.nbytes)
        dist.recv(work, src=self._global(src), group=self._group)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    # -- objects (pickled into uint8 tensors on this group's device) -------------------------------
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.rank == src:
            payload = self._pickle(obj)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=self._global(src), group=self._group)
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, src=self._global(src), group=self._group)
        count(self.stats, "broadcast_object", payload.numel())
        return obj if self.rank == src else _unpickle(payload)

    def all_gather_object(self, obj: Any) -> list[Any]:
        payload = self._pickle(obj)
        count(self.stats, "all_gather_object", payload.numel())
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        dist.all_gather(list(sizes.split(1)), size, group=self._group)
        sizes = sizes.tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        padded[:payload.numel()] = payload
        stacked = torch.empty((self.world_size, max(sizes)), dtype=torch.uint8, device=self.device)
        dist.all_gather(list(stacked.unbind(0)), padded, group=self._group)
        return [obj if r == self.rank else _unpickle(stacked[r, :n]) for r, n in enumerate(sizes)]

    def _pickle(self, obj: Any) -> torch.Tensor:
        data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        return torch.frombuffer(data, dtype=torch.uint8).to(self.device)

    # -- control -----------------------------------------------------------------------------------
    def barrier(self) -> None:
        count(self.stats, "barrier", 0)
        if self.bind_device:
            dist.barrier(group=self._group, device_ids=[self.device.index or 0])
        else:
            dist.barrier(group=self._group)

    def new_group(self, partition: list[list[int]]) -> TorchDistributedCollective:
        check_partition(partition, self.world_size)
        mine: tuple[Any, list[int]] | None = None
        for group in partition:  # torch wants every rank to create every group, in the same order
            members = [self._ranks[r] for r in group]
            made = dist.new_group(ranks=members, timeout=self._timeout, backend=self.backend)
            if self.rank in group:
                mine = (made, members)
        assert mine is not None  # check_partition: every rank is in one group
        return TorchDistributedCollective(self.backend, self.device, self._timeout, *mine,
                                          gather_into_tensor=self.gather_into_tensor, bind_device=self.bind_device)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not dist.is_initialized():  # the world was closed first: its groups went with it
            return
        if self._group is None:
            dist.destroy_process_group()
            self._store = None
        else:
            try:
                dist.destroy_process_group(self._group)
            except (RuntimeError, ValueError):  # already gone
                pass

    def _global(self, group_rank: int) -> int:
        if not 0 <= group_rank < self.world_size:
            raise ValueError(f"rank {group_rank} is not in this group of {self.world_size}")
        return self._ranks[group_rank]

    def __repr__(self) -> str:
        return f"TorchDistributedCollective({self.backend}, rank {self.rank} of {self.world_size})"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _unpickle(payload: torch.Tensor) -> Any:
    return pickle.loads(payload.cpu().numpy().tobytes())


# -- rendezvous ----------------------------------------------------------------------------------------
def join(backend: str, config: EngineConfig, rank: RankInfo, device: torch.device,
         gather_into_tensor: bool = False, bind_device: bool = False) -> TorchDistributedCollective:
    """Join the world of ``rank.world_size`` processes over the torch.distributed ``backend`` (a library name
    such as "gloo", "nccl", "eccl"), tensors on ``device``; bounded by ``config.parallel.timeout_s``."""
    if dist.is_initialized():
        raise RuntimeError(f"collective {backend}: this process already has a torch.distributed world "
                           "(close the previous collective first)")
    seconds = config.parallel.timeout_s
    timeout = timedelta(seconds=seconds)
    if rank.launcher == "torchrun":
        where = f"env:// ({os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')})"
        try:
            store, _, _ = next(dist.rendezvous("env://", rank=rank.rank, world_size=rank.world_size,
                                               timeout=timeout))
        except (RuntimeError, ValueError) as exc:
            raise RuntimeError(f"collective {backend}: rank {rank.rank} could not join the rendezvous at "
                               f"{where} within {seconds:g} s: {_first_line(exc)}") from exc
        key = f"arrived/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    else:
        if rank.master_port == 0 and rank.world_size > 1:
            raise ValueError(f"collective {backend}: {rank.world_size} ranks need a rendezvous port; "
                             "master_port 0 is only for one rank (the launcher picks a free port)")
        where = f"tcp://{rank.master_addr}:{rank.master_port}"
        master = rank.rank == 0
        try:
            store = dist.TCPStore(rank.master_addr, rank.master_port, rank.world_size, is_master=master,
                                  timeout=timeout, wait_for_workers=False)
        except (RuntimeError, ValueError) as exc:
            doing = "open" if master else "reach rank 0 at"
            raise RuntimeError(f"collective {backend}: rank {rank.rank} could not {doing} the rendezvous "
                               f"{where} within {seconds:g} s: {_first_line(exc)}") from exc
        key = "arrived"
    _wait_for_everyone(dist.PrefixStore("pluginfer", store), key, backend, rank, where, seconds)
    extra = {"device_id": device} if bind_device else {}
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank.rank,
                            world_size=rank.world_size, timeout=timeout, **extra)
    return TorchDistributedCollective(backend, device, timeout, store=store, gather_into_tensor=gather_into_tensor,
                                      bind_device=bind_device)


def _wait_for_everyone(store: Any, key: str, backend: str, rank: RankInfo, where: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    arrived = 0
    try:
        arrived = store.add(key, 1)
        while arrived < rank.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(0.02)
            arrived = store.add(key, 0)
    except (TimeoutError, RuntimeError) as exc:
        cause = "" if isinstance(exc, TimeoutError) else f" (rendezvous lost: {_first_line(exc)})"
        raise RuntimeError(f"collective {backend}: {arrived} of {rank.world_size} ranks arrived at the "
                           f"rendezvous {where} within {seconds:g} s{cause}") from exc
