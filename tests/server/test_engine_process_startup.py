"""The engine core process's start-up: the phases it reports, the tokenizer it takes from the server, the first
frame it reads, what the server imports before it spawns the core, and the core's OpenMP spin count.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pluginfer.core.config import build_config
from pluginfer.engine.engine_core import EngineCore
from pluginfer.engine.messages import (
    AddRequest,
    ServerTokenizer,
    Stop,
    encode,
    receive_frame,
)
from pluginfer.server.core_client import CoreProcessClient
from tests.server.conftest import server_config


def test_a_gguf_core_reports_its_start_up_phases_and_takes_the_servers_tokenizer(
        tiny_llama_checkpoint, tmp_path, monkeypatch, capfd):
    """A core on a GGUF file reports each start-up phase; the tokenizer the server built from the file with the
    `tokenizers` library alone (formats/gguf/tokenizer.py, nothing cached) is the one the core takes (it builds
    none), and a second start serves the same text."""
    import asyncio

    from pluginfer.cli.convert import convert_to_gguf
    from pluginfer.engine.sequence import SamplingParams
    from pluginfer.formats.gguf.tokenizer import GGUFTokenizer

    path = convert_to_gguf(tiny_llama_checkpoint[0], tmp_path / "tiny.gguf", "q8_0", "f32")
    monkeypatch.setenv("PLUGINFER_CACHE", str(tmp_path / "cache"))
    config = build_config(model=str(path), dtype="float32", **{"cache.num_blocks": 32, "cache.block_size": 8})
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def text(client: CoreProcessClient) -> str:
        return [o async for o in client.generate("hello world", params)][-1].outputs[0].text

    texts = []
    for _ in range(2):
        client = CoreProcessClient(config, log_level="INFO").start(timeout=300)
        try:
            assert "(engine core): tokenizer taken in" in capfd.readouterr().err
            assert set(client.startup_times) - {"graphs"} == {"start", "imports", "config", "build", "load", "repack",
                                                              "cache", "tokenizer", "other", "warm-up", "total"}
            assert all(seconds >= 0 for seconds in client.startup_times.values())
            assert isinstance(client.tokenizer, GGUFTokenizer)
            texts.append(asyncio.run(text(client)))
        finally:
            client.shutdown()
    assert texts[0] == texts[1] and texts[0]
    assert not (tmp_path / "cache" / "tokenizers").exists()


def test_the_core_reads_exactly_one_frame_and_wants_the_tokenizer_first():
    server, core = socket.socketpair()
    with server, core:
        big = "x" * (3 << 20)  # larger than the socket's buffer: it arrives in pieces
        sender = threading.Thread(target=server.sendall, args=(encode(ServerTokenizer(big)) + encode(Stop()),))
        sender.start()
        assert EngineCore(None, core)._receive_tokenizer() == big
        sender.join()
        assert receive_frame(core) == Stop()  # the frame after it stays for the reader
        server.sendall(encode(AddRequest("r", "hi", None)))
        with pytest.raises(RuntimeError, match="the server sent AddRequest before its tokenizer"):
            EngineCore(None, core)._receive_tokenizer()
        server.close()
        with pytest.raises(OSError, match="the server closed its end"):
            receive_frame(core)


def _in_a_server_process(model: Path, then: str) -> str:
    """Run what `pluginfer serve` runs before it spawns the core (the CLI's parser and the config for
    ``model``), then ``then``, in a fresh interpreter; its stdout."""
    code = ("import pickle, subprocess, sys\n"
            "from pluginfer.cli import build_parser\n"
            "from pluginfer.cli.serve import serve_config\n"
            f"serve_config(build_parser().parse_args(['serve', '--model', {str(model)!r}]))\n" + then)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_server_process_imports_no_torch_nor_transformers(tmp_path):
    """Nothing `pluginfer serve` runs in its own process imports torch or transformers: the CLI's parser, the
    config, server/launch.py, the app and its handlers, the engine client, and the GGUF file's tokenizer the
    core hands over (unpickled; built here by a child, as the core builds it). So the server's start-up
    overlaps the core's, and its process holds ~100 MB, not torch's several hundred. sys.modules, not a timing."""
    gguf = Path(__file__).parents[1] / "quant" / "fixtures" / "llamacpp-qwen2-q8_0.gguf"
    core = ("import pickle, sys; from pluginfer.text.tokenizer import load_tokenizer; "
            "sys.stdout.buffer.write(pickle.dumps(load_tokenizer(sys.argv[1])))")
    then = ("import pluginfer.server.launch, pluginfer.server.app, pluginfer.server.core_client\n"
            f"tokenizer = pickle.loads(subprocess.run([sys.executable, '-c', {core!r}, {str(gguf)!r}],\n"
            "                                         capture_output=True, check=True).stdout)\n"
            "tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    assert _in_a_server_process(tmp_path, then) == "[]"


def test_the_server_spawns_the_core_before_it_imports_aiohttp(tmp_path):
    """`pluginfer serve` starts the core from server/launch.py's start_engine; what it imports up to there
    (the CLI, the config, launch.py, the engine client) leaves aiohttp (~0.1 s) for after the spawn, so the
    core's start does not wait for it. sys.modules, not a timing."""
    then = "import pluginfer.server.launch, pluginfer.server.core_client\nprint('aiohttp' in sys.modules)\n"
    assert _in_a_server_process(tmp_path, then) == "False"


@pytest.mark.parametrize(("environ", "spin_count", "expected"), [
    ({}, 0, {"OMP_WAIT_POLICY": "PASSIVE"}),  # sleep at once
    ({}, 200000, {"GOMP_SPINCOUNT": "200000"}),  # spin ~2 ms, then sleep
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 200000, {"OMP_WAIT_POLICY": "ACTIVE"}),  # the user's own choice wins
    ({"GOMP_SPINCOUNT": "5"}, 0, {"GOMP_SPINCOUNT": "5"}),
])
def test_the_core_waits_as_core_spin_count_says_unless_the_environment_does(environ, spin_count, expected):
    from pluginfer.server.core_process import core_environment

    env = core_environment(spin_count, {"PATH": "/bin", **environ})
    assert {key: env[key] for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if key in env} == expected
    assert env["PATH"] == "/bin"


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc/PID/environ")
def test_core_spin_count_reaches_the_engine_core_process(tiny_llama_checkpoint, monkeypatch):
    """`--core-spin-count` is in the environment the core process started with (its OpenMP runtime reads
    it once, when it loads)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    client = CoreProcessClient(server_config(tiny_llama_checkpoint[0], **{"server.core_spin_count": 123456})).start()
    try:
        environ = Path(f"/proc/{client.process.pid}/environ").read_bytes().split(b"\0")
        assert b"GOMP_SPINCOUNT=123456" in environ
        assert not any(item.startswith(b"OMP_WAIT_POLICY=") for item in environ)
    finally:
        client.shutdown()


def test_serve_takes_core_spin_count_and_refuses_a_negative_one(tmp_path):
    from pluginfer.cli import build_parser
    from pluginfer.cli.serve import serve_config

    parse = build_parser().parse_args
    assert serve_config(parse(["serve", "--model", str(tmp_path)])).server.core_spin_count == 300000
    config = serve_config(parse(["serve", "--model", str(tmp_path), "--core-spin-count", "100000"]))
    assert config.server.core_spin_count == 100000
    with pytest.raises(ValueError, match="core_spin_count"):
        serve_config(parse(["serve", "--model", str(tmp_path), "--core-spin-count", "-1"]))


def test_core_spin_count_with_the_engine_in_the_server_process_says_it_does_not_apply(
        tiny_llama_checkpoint, monkeypatch, caplog):
    from pluginfer.server import launch

    monkeypatch.setenv("PLUGINFER_ENGINE_PROCESS", "0")
    caplog.set_level(logging.WARNING, logger="pluginfer.server.launch")
    engine = launch.start_engine(server_config(tiny_llama_checkpoint[0], **{"server.core_spin_count": 1000}))
    try:
        assert "--core-spin-count applies to the engine core process only" in caplog.text
    finally:
        engine.shutdown()


def test_the_default_spin_count_with_the_engine_in_the_server_process_says_nothing(
        tiny_llama_checkpoint, monkeypatch, caplog):
    from pluginfer.server import launch

    monkeypatch.setenv("PLUGINFER_ENGINE_PROCESS", "0")
    caplog.set_level(logging.WARNING, logger="pluginfer.server.launch")
    engine = launch.start_engine(server_config(tiny_llama_checkpoint[0]))
    try:
        assert "--core-spin-count" not in caplog.text
    finally:
        engine.shutdown()
