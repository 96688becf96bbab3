"""The engine core's process spawned ahead of its config (`pluginfer serve` starts it first thing): taken when
the config runs the core in a process of its own with the environment it was spawned with, else discarded;
one that gets no config exits quietly, and none is left behind by a `pluginfer serve` that fails."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pluginfer.cli import _serves_through_a_core_process
from pluginfer.core.config import DEFAULT_CORE_SPIN_COUNT
from pluginfer.engine.async_engine import AsyncEngine
from pluginfer.server import core_process
from pluginfer.server.core_client import CoreProcessClient
from pluginfer.server.core_process import CoreProcess, prespawn
from pluginfer.server.launch import start_engine
from tests.server.conftest import server_config


@pytest.fixture
def spawned_ahead():
    """The process `prespawn` started (discarded afterwards if no engine took it)."""
    prespawn()
    process = core_process._prespawned
    assert process is not None and process.spin_count == DEFAULT_CORE_SPIN_COUNT
    yield process.process
    core_process.discard_prespawned()


def test_a_core_spawned_ahead_is_the_one_the_server_starts(tiny_llama_checkpoint, spawned_ahead):
    client = start_engine(server_config(tiny_llama_checkpoint[0]))
    try:
        assert isinstance(client, CoreProcessClient) and client.process is spawned_ahead and client.is_alive
        assert core_process._prespawned is None and client.startup_times["start"] >= 0
    finally:
        client.shutdown()


def test_a_core_spawned_ahead_for_another_environment_is_discarded(tiny_llama_checkpoint, spawned_ahead):
    client = start_engine(server_config(tiny_llama_checkpoint[0], **{"server.core_spin_count": 1234}))
    try:
        assert client.process is not spawned_ahead and spawned_ahead.wait(timeout=10) == 0
    finally:
        client.shutdown()


def test_a_core_spawned_ahead_of_an_engine_in_this_process_is_discarded(tiny_llama_checkpoint, spawned_ahead,
                                                                      monkeypatch):
    monkeypatch.setenv("PLUGINFER_ENGINE_PROCESS", "0")
    engine = start_engine(server_config(tiny_llama_checkpoint[0]))
    try:
        assert isinstance(engine, AsyncEngine) and spawned_ahead.wait(timeout=10) == 0
    finally:
        engine.shutdown()


def test_a_core_that_gets_no_config_exits_quietly(capfd):
    process = CoreProcess()
    process.discard()
    assert process.process.returncode == 0 and capfd.readouterr().err == ""


@pytest.mark.parametrize(("argv", "launcher", "environ", "expected"), [
    (["serve", "--model", "m"], None, {}, True),
    (["serve", "--model", "m", "--tensor-parallel-size", "2"], None, {}, True),  # the config discards it
    (["serve", "--help"], None, {}, False),
    (["serve", "-h"], None, {}, False),
    (["generate", "--model", "m"], None, {}, False),
    ([], None, {}, False),
    (["serve", "--model", "m"], "torchrun", {}, False),
    (["serve", "--model", "m"], None, {"PLUGINFER_ENGINE_PROCESS": "0"}, False),
    (["serve", "--model", "m", "--core-spin-count", "0"], None, {}, False),
    (["serve", "--model", "m", "--core-spin-count=0"], None, {}, False),
])
def test_which_commands_spawn_a_core_ahead(argv, launcher, environ, expected, monkeypatch):
    monkeypatch.delenv("PLUGINFER_ENGINE_PROCESS", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert _serves_through_a_core_process(argv, launcher) is expected


def _processes_marked(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"PLUGINFER_TEST_MARK={mark}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc/PID/environ")
def test_a_serve_with_a_bad_config_names_the_field_and_leaves_no_process(tmp_path):
    mark = uuid.uuid4().hex
    result = subprocess.run([sys.executable, "-m", "pluginfer", "serve", "--model", str(tmp_path), "--max-num-seqs",
                             "0"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PLUGINFER_TEST_MARK": mark})
    assert result.returncode != 0 and "max_num_seqs" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert _processes_marked(mark) == []  # the core spawned ahead went with it
