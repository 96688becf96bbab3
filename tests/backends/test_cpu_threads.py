"""How many CPU threads the cpu backend computes with: ``--threads`` (``EngineConfig.threads``), else
``PLUGINFER_CPU_THREADS``, else every core (divided among the ranks of one machine); a bad value is an error
naming where it came from."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pluginfer.backends.cpu.backend import THREADS_ENV, CpuBackend
from pluginfer.core.config import build_config
from pluginfer.core.protocols import RankInfo


@pytest.fixture(autouse=True)
def restore_threads(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def test_the_configs_threads_win_over_the_environment(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "2")
    CpuBackend(build_config(model="demo", threads=1))
    assert torch.get_num_threads() == 1
    CpuBackend(build_config(model="demo"))  # no threads in the config: the environment's
    assert torch.get_num_threads() == 2


def test_threads_given_apply_to_each_rank_of_one_machine_as_they_are():
    CpuBackend(build_config(model="demo", threads=1), RankInfo(rank=0, world_size=2, tp_size=2, local_world_size=2))
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_a_bad_environment_value_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(THREADS_ENV, value)
    with pytest.raises(ValueError, match=rf"{THREADS_ENV}='{value}': expected a positive number of threads"):
        CpuBackend(build_config(model="demo"))


def test_the_flag_reaches_the_engine_and_a_bad_one_names_the_field():
    script = ("import torch; from pluginfer import LLM; LLM(model='demo', threads=1); "
              "print(torch.get_num_threads())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1"
    bad = subprocess.run([sys.executable, "-m", "pluginfer", "generate", "--model", "demo", "--prompt", "x",
                          "--threads", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "threads: Input should be greater than or equal to 1" in bad.stderr
