"""Distributed settings that cannot work fail at start-up, naming the field and the numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pluginfer import LLM
from pluginfer.core.config import build_config
from pluginfer.core.registry import UnknownPluginError
from pluginfer.engine.launch import free_port, rank_info
from tests.checkpoints import copy_with_config

ENGINE = dict(dtype="float32", num_blocks=16, block_size=8, timeout_s=30.0)


@pytest.mark.slow
def test_tensor_parallel_size_that_does_not_divide_the_heads(tiny_llama_checkpoint, tmp_path: Path) -> None:
    path = copy_with_config(tiny_llama_checkpoint[0], tmp_path / "m", {"num_attention_heads": 4,
                                                                       "num_key_value_heads": 4})
    with pytest.raises(ValueError, match=r"num_attention_heads 4 .*tensor-parallel size 3"):
        LLM(str(path), tensor_parallel_size=3, **ENGINE)


@pytest.mark.slow
def test_tensor_parallel_size_that_does_not_divide_the_intermediate_size(tiny_llama_checkpoint,
                                                                        tmp_path: Path) -> None:
    path = copy_with_config(tiny_llama_checkpoint[0], tmp_path / "m", {"intermediate_size": 130})
    with pytest.raises(ValueError, match=r"intermediate_size 130.*4"):
        LLM(str(path), tensor_parallel_size=4, **ENGINE)


@pytest.mark.slow
def test_tensor_parallel_split_inside_a_quant_block(tiny_llama_checkpoint) -> None:
    """In-situ Q8_0 on 4 ranks: o_proj's 64 inputs would split into 16-input shards, half a 32-wide block."""
    with pytest.raises(ValueError, match=r"16.*32|32.*16"):
        LLM(str(tiny_llama_checkpoint[0]), tensor_parallel_size=4, quant="q8_0", **ENGINE)


@pytest.mark.slow
def test_more_pipeline_stages_than_layers(tiny_llama_checkpoint) -> None:
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 3 is larger than the model's num_hidden_layers 2"):
        LLM(str(tiny_llama_checkpoint[0]), pipeline_parallel_size=3, **ENGINE)


def test_unknown_collective_lists_what_exists(tiny_llama_checkpoint) -> None:
    with pytest.raises(UnknownPluginError, match=r"gloo.*mpi|mpi.*gloo"):
        LLM(str(tiny_llama_checkpoint[0]), tensor_parallel_size=2, collective="carrier-pigeon", **ENGINE)


def test_inprocess_launcher_runs_one_rank() -> None:
    config = build_config(model="demo", **{"parallel.tensor_parallel_size": 2, "parallel.launcher": "inprocess"})
    with pytest.raises(ValueError, match="parallel.launcher: inprocess runs one rank"):
        rank_info(config, {})


def test_launcher_environment_must_match_the_parallel_sizes() -> None:
    config = build_config(model="demo", **{"parallel.tensor_parallel_size": 2})
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    with pytest.raises(ValueError, match=r"torchrun launcher started 3 ranks.*tensor_parallel_size 2"):
        rank_info(config, env)
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "x"}
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK='x' is not an integer"):
        rank_info(config, mpi)


def test_launcher_environment_gives_the_rank_and_its_coordinates() -> None:
    config = build_config(model="demo", **{"parallel.tensor_parallel_size": 2, "parallel.pipeline_parallel_size": 2})
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    rank = rank_info(config, env)
    assert (rank.rank, rank.tp_rank, rank.pp_rank, rank.local_rank, rank.launcher) == (3, 1, 1, 1, "torchrun")
    assert (rank.master_addr, rank.master_port) == ("10.0.0.1", 29500)
    assert rank.tp_groups() == [[0, 1], [2, 3]] and rank.pp_groups() == [[0, 2], [1, 3]]


@pytest.mark.slow
def test_ranks_that_disagree_on_the_config_fail_at_start(tiny_llama_checkpoint) -> None:
    """Two torchrun nodes started with different --max-num-seqs: both fail naming what differs."""
    port = free_port("127.0.0.1")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    nodes = []
    for node, seqs in ((0, "4"), (1, "8")):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "pluginfer", "generate", "--prompt", "hi", "--max-tokens", "2", "--model",
                   str(tiny_llama_checkpoint[0]), "--num-blocks", "16", "--tensor-parallel-size", "2",
                   "--max-num-seqs", seqs, "--distributed-timeout", "30"]
        nodes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        results = [process.communicate(timeout=120) for process in nodes]
    finally:
        for process in nodes:
            if process.poll() is None:
                process.kill()
    assert all(process.returncode != 0 for process in nodes)
    assert "rank 1 disagrees with rank 0 on config scheduler" in results[0][1], results[0][1][-2000:]
