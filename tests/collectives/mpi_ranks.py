"""Run by the tests as ``mpiexec -n 2 python tests/collectives/mpi_ranks.py SCENARIO``; prints one line per rank.

SCENARIO: ``contract`` (the shared checks), ``dead_peer`` (rank 1 exits mid-job: mpiexec must end the
job rather than leave rank 0 blocked), ``mismatch`` (run without mpiexec while claiming two ranks:
the factory must refuse).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.collectives


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def main(scenario: str) -> None:
    import torch

    from pluginfer.collectives.mpi import build
    from pluginfer.core.config import EngineConfig
    from pluginfer.core.protocols import RankInfo
    from pluginfer.testing.collective_contract import check_contract

    rank = _env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK", default=0)
    world = _env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)
    if scenario == "mismatch":
        rank, world = 1, 2
    config = EngineConfig(model="unused", parallel={"tensor_parallel_size": world, "collective": "mpi"})
    info = RankInfo(rank=rank, world_size=world, tp_size=world, launcher="mpi")
    try:
        coll = build(config, info)
    except RuntimeError as exc:
        print(f"rank {rank} factory refused: {exc}", flush=True)
        sys.exit(3)
    if scenario == "contract":
        stats = check_contract(coll, count_traffic=True)
        print(f"rank {rank} contract ok {sorted(stats)}", flush=True)
    elif scenario == "dead_peer":
        coll.barrier()
        if rank == 1:
            print("rank 1 exiting", flush=True)
            os._exit(7)
        coll.all_reduce(torch.ones(4))
        print("rank 0 all_reduce returned", flush=True)
    else:
        raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    main(sys.argv[1])
