"""Launchers: where this process sits among the ranks, and starting the ranks a driver spawns.

A launcher only produces a ``RankInfo`` (and, for ``spawn``, the local workers); the engine does not know which
ran. ``inprocess``: one rank. ``spawn``: this process is rank 0 and starts ranks 1..N-1 locally
(``python -m pluginfer.engine.launch``), meeting at ``parallel.master_addr``. ``torchrun``: ranks from its
environment, possibly on several machines. ``mpi``: ranks from ``mpiexec``'s (Open MPI or MPICH).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from pluginfer.core.config import EngineConfig
from pluginfer.core.protocols import RankInfo
from pluginfer.engine.launcher_env import die_with_parent, external_launcher, leave_launched_rank

logger = logging.getLogger(__name__)


def detect_launcher(config: EngineConfig, environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    launcher = config.parallel.launcher
    if launcher != "auto":
        return launcher
    external = external_launcher(env)
    if external is not None:
        return external
    world = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size
    return "spawn" if world > 1 else "inprocess"


def rank_info(config: EngineConfig, environ: dict[str, str] | None = None) -> RankInfo:
    """This process's place in the deployment, from the config and the launcher's environment."""
    env = os.environ if environ is None else environ
    parallel = config.parallel
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    world = tp * pp
    launcher = detect_launcher(config, env)
    if launcher == "inprocess":
        if world != 1:
            raise ValueError(f"parallel.launcher: inprocess runs one rank, but tensor_parallel_size {tp} x "
                             f"pipeline_parallel_size {pp} asks {world} (use spawn, torchrun or mpi)")
        return RankInfo()
    if launcher == "spawn":
        port = parallel.master_port or free_port(parallel.master_addr)
        return RankInfo(0, world, tp, pp, 0, world, parallel.master_addr, port, "spawn")
    if launcher == "torchrun":
        fields = _read_env(env, "torchrun", rank="RANK", world="WORLD_SIZE", local_rank="LOCAL_RANK",
                           local_world="LOCAL_WORLD_SIZE")
        addr, port = env.get("MASTER_ADDR", parallel.master_addr), int(env.get("MASTER_PORT", parallel.master_port))
    else:
        names = ({"rank": "OMPI_COMM_WORLD_RANK", "world": "OMPI_COMM_WORLD_SIZE",
                  "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK", "local_world": "OMPI_COMM_WORLD_LOCAL_SIZE"}
                 if "OMPI_COMM_WORLD_SIZE" in env else
                 {"rank": "PMI_RANK", "world": "PMI_SIZE", "local_rank": "MPI_LOCALRANKID",
                  "local_world": "MPI_LOCALNRANKS"})
        fields = _read_env(env, "mpi", **names)
        addr, port = parallel.master_addr, parallel.master_port
    if fields["world"] != world:
        raise ValueError(f"parallel: the {launcher} launcher started {fields['world']} ranks, but "
                         f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {world}")
    return RankInfo(fields["rank"], world, tp, pp, fields["local_rank"], fields["local_world"], addr, port, launcher)


def _read_env(env: dict[str, str], launcher: str, **names: str) -> dict[str, int]:
    values = {}
    for key, variable in names.items():
        if variable not in env:
            if key.startswith("local"):  # some launchers leave these out: one rank per machine
                values[key] = 0 if key == "local_rank" else 1
                continue
            raise ValueError(f"parallel.launcher {launcher}: environment variable {variable} is not set "
                             f"(start the ranks with {'torchrun' if launcher == 'torchrun' else 'mpiexec'})")
        try:
            values[key] = int(env[variable])
        except ValueError:
            raise ValueError(f"parallel.launcher {launcher}: {variable}={env[variable]!r} is not an integer") from None
    return values


def free_port(host: str) -> int:
    """A port nobody listens on now (another process could take it before rank 0 binds it: rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalWorkers:
    """Ranks 1..N-1 as local processes (``python -m pluginfer.engine.launch``); a watcher reports the first
    one that dies. Plain subprocesses, not ``multiprocessing``: a user's script is never re-imported
    (no ``if __name__ == "__main__"`` needed), and on Linux a worker dies with its driver."""

    def __init__(self, config: EngineConfig, rank: RankInfo, on_death: Callable[[str], None]) -> None:
        self.processes: list[tuple[int, subprocess.Popen]] = []
        for other in range(1, rank.world_size):
            info = dataclasses.replace(rank, rank=other, local_rank=other)
            process = subprocess.Popen(
                [sys.executable, "-m", "pluginfer.engine.launch", json.dumps(dataclasses.asdict(info))],
                stdin=subprocess.PIPE, preexec_fn=die_with_parent if sys.platform == "linux" else None)
            process.stdin.write(config.model_dump_json().encode())
            process.stdin.close()
            self.processes.append((other, process))
        self.stopping = False
        self._on_death = on_death
        for other, process in self.processes:
            threading.Thread(target=self._watch, args=(other, process), name=f"pluginfer-watch-rank-{other}",
                             daemon=True).start()

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if not self.stopping:
            self._on_death(f"rank {rank} (pid {process.pid}) exited with code {code}")

    def join(self, timeout: float) -> None:
        """Wait for the workers to leave after the driver's stop message; kill what is left."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for rank, process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("rank %d did not exit within %.0f s; terminating it", rank, timeout)
                process.terminate()
                try:
                    process.wait(5)
                except subprocess.TimeoutExpired:
                    process.kill()

    def kill(self) -> None:
        self.stopping = True
        for _, process in self.processes:
            if process.poll() is None:
                process.kill()


def _worker_main(argv: list[str]) -> int:
    """``python -m pluginfer.engine.launch RANK_INFO_JSON`` with the config's JSON on stdin."""
    rank = RankInfo(**json.loads(argv[0]))
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {rank.rank} %(levelname)s %(name)s: %(message)s")
    config = EngineConfig.model_validate_json(sys.stdin.read())
    return run_worker(config, rank)


def serve_if_worker(config: EngineConfig) -> None:
    """On a rank that torchrun or mpiexec started other than rank 0: serve the driver's steps, then exit.

    Engines call this first, so ``pluginfer serve``, ``pluginfer generate`` and a script building
    ``LLM(...)`` run unchanged on every rank; only rank 0 gets past it.
    """
    if detect_launcher(config) not in ("torchrun", "mpi"):
        return
    rank = rank_info(config)
    if not rank.is_driver:
        code = run_worker(config, rank)
        leave_launched_rank(code)
        raise SystemExit(code)



def run_worker(config: EngineConfig, rank: RankInfo) -> int:
    """Build this rank (a non-driver) and run the steps the driver broadcasts; 0 after a clean stop."""
    from pluginfer.core.registry import get_registry
    from pluginfer.engine.executor import start_rank

    try:
        started = start_rank(config, rank, get_registry())
    except Exception as exc:  # rank 0 reports the same error in full; one line here
        logger.error("rank %d: could not start: %s: %s", rank.rank, type(exc).__name__, exc)
        return 1
    worker = started.worker
    try:
        while True:
            message = worker.world.broadcast_object(None, src=0)
            if message is None:
                return 0
            if message == "ping":
                continue
            worker.execute(message)
    except Exception as exc:  # the driver or a peer is gone: say so in one line
        logger.error("rank %d: leaving: %s: %s", rank.rank, type(exc).__name__, exc)
        return 1
    finally:
        worker.world.close()


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1:]))
