"""What each spawned gloo rank runs in the tests (importable by ``multiprocessing``'s spawn)."""

from __future__ import annotations

import os
import time
import traceback

import torch

SCENARIOS = ("contract", "upcast", "dead_peer", "silent_peer")


def rank_main(scenario: str, rank: int, world_size: int, port: int, timeout_s: float, results) -> None:
    """Build the gloo collective as the engine would, run ``scenario``, put ``(rank, ok, payload)``."""
    try:
        from pluginfer.collectives.torch_distributed import build_gloo
        from pluginfer.core.config import EngineConfig
        from pluginfer.core.protocols import RankInfo
        from pluginfer.testing.collective_contract import check_contract

        config = EngineConfig(model="unused", parallel={"tensor_parallel_size": world_size, "timeout_s": timeout_s})
        info = RankInfo(rank=rank, world_size=world_size, tp_size=world_size, local_rank=rank,
                        local_world_size=world_size, master_port=port, launcher="spawn")
        coll = build_gloo(config, info)
        if scenario == "contract":
            payload = check_contract(coll, count_traffic=True)
        elif scenario == "upcast":  # the float32 detour of half sums, taken when gloo cannot sum them
            coll._upcast.update((torch.bfloat16, torch.float16))
            tensor = torch.tensor([0.5, 1.5, 256.0], dtype=torch.bfloat16) * (rank + 1)
            coll.all_reduce(tensor)
            assert torch.equal(tensor, torch.tensor([1.5, 4.5, 768.0], dtype=torch.bfloat16)), tensor
            assert coll.stats["all_reduce"] == [1, 12], coll.stats  # three float32 on the wire
            payload = check_contract(coll, count_traffic=True)
        elif scenario in ("dead_peer", "silent_peer"):
            coll.barrier()
            if rank == 1:
                if scenario == "silent_peer":
                    time.sleep(timeout_s + 2)  # alive, connected, never answering
                os._exit(0)  # dies without a word; rank 0 reports
            time.sleep(0.5)
            start = time.monotonic()
            try:
                coll.all_reduce(torch.ones(4))
            except RuntimeError as exc:
                payload = {"seconds": time.monotonic() - start, "error": str(exc).splitlines()[0][:300]}
            else:
                raise AssertionError("all_reduce with a dead peer returned")
            coll.close()
        else:
            raise ValueError(scenario)
        results.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, False, traceback.format_exc()))


def torchrun_main() -> None:
    """``torchrun --nproc-per-node 2 tests/collectives/gloo_ranks.py``: the contract through ``env://``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from pluginfer.collectives.torch_distributed import build_gloo
    from pluginfer.core.config import EngineConfig
    from pluginfer.core.protocols import RankInfo
    from pluginfer.testing.collective_contract import check_contract

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = EngineConfig(model="unused", parallel={"tensor_parallel_size": world, "timeout_s": 20.0})
    info = RankInfo(rank=rank, world_size=world, tp_size=world, local_rank=int(os.environ["LOCAL_RANK"]),
                    local_world_size=world, launcher="torchrun")
    stats = check_contract(build_gloo(config, info), count_traffic=True)
    print(f"rank {rank} contract ok {sorted(stats)}", flush=True)


if __name__ == "__main__":
    torchrun_main()
