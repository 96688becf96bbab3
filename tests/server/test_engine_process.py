"""The engine core in its own process (``pluginfer serve``'s default): how it fails and how it stops.

A killed core is noticed at once (streams end with an error event, /health is 503 saying which process
died, one log line), a core whose loop fails says why, shutdown ends what runs and the process exits,
a core outlives neither a clean nor a killed server, start-up errors come back as the same errors.
Never a hang: every wait is bounded, and the bounds are failures, not measurements.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pluginfer.core.config import build_config
from pluginfer.engine.client import EngineStats
from pluginfer.engine.engine_core import EngineCore
from pluginfer.engine.messages import (
    AddRequest,
    Failure,
    FrameReader,
    Outputs,
    Stop,
    encode,
)
from pluginfer.server.core_client import CoreProcessClient
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import MODEL_NAME, NUM_BLOCKS, http, server_config, sse_events


def _gone(pid: int) -> bool:
    """The process exited (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_for(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.02)


@pytest.fixture
def core_server(tiny_llama_checkpoint):
    """An engine core process of its own and a server over it; both stopped afterwards."""
    client = CoreProcessClient(server_config(tiny_llama_checkpoint[0])).start()
    server = BackgroundServer(client, server_config(tiny_llama_checkpoint[0]))
    yield client, server
    server.stop()
    client.shutdown()


def _open_stream(server: BackgroundServer):  # noqa: ANN202
    """A streamed completion that runs to the end of the context (4 choices), after its first event arrived."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 250, "ignore_eos": True,
                       "stream": True, "n": 4}).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=30)
    first = response.readline()
    assert first.startswith(b"data: ") and response.readline() == b"\n", first
    return response


def test_a_killed_engine_process_is_503_logged_and_ends_open_streams(core_server, caplog):
    client, server = core_server
    caplog.set_level(logging.ERROR, logger="pluginfer.server.core_client")
    pid = client.process.pid
    assert http(server, "GET", "/health")[0] == 200
    response = _open_stream(server)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    rest = response.read()  # the stream must end, not hang (urlopen's timeout bounds each read)
    assert time.monotonic() - killed < 10
    *_, error, done = sse_events(rest)
    assert done == "[DONE]" and f"pid {pid}" in error["error"]["message"], error
    status, _, raw = http(server, "GET", "/health")
    assert status == 503 and f"the engine process (pid {pid}) exited on signal SIGKILL" in raw.decode()
    assert http(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 503
    assert not client.is_alive and client.num_requests == 0
    lines = [r.getMessage() for r in caplog.records if f"engine process (pid {pid})" in r.getMessage()]
    assert len(lines) == 1 and "SIGKILL" in lines[0], caplog.text


def test_a_killed_idle_engine_process_is_noticed_without_a_request(core_server):
    client, server = core_server
    os.kill(client.process.pid, signal.SIGKILL)
    _wait_for(lambda: not client.is_alive, 10, "the dead core noticed")
    status, _, raw = http(server, "GET", "/health")
    assert status == 503 and "SIGKILL" in raw.decode()


def test_shutdown_ends_open_streams_and_the_process_exits(core_server):
    client, server = core_server
    response = _open_stream(server)
    stopper = threading.Thread(target=client.shutdown)  # as the server's stop does: off its event loop
    stopper.start()
    events = sse_events(response.read())
    stopper.join(20)
    assert not stopper.is_alive()
    assert events[-1] == "[DONE]" and "shut down" in events[-2]["error"]["message"], events[-2:]
    assert client.process.returncode == 0 and not client.is_alive and client.error is None
    assert http(server, "GET", "/health")[0] == 503
    client.shutdown()  # again: nothing left to do


def test_requests_the_core_refuses_are_400s_and_leave_it_running(core_server):
    client, server = core_server
    status, _, raw = http(server, "POST", "/v1/completions", {"prompt": [10**7], "max_tokens": 2})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"
    status, _, raw = http(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3,
                                                               "temperature": 0, "ignore_eos": True})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    assert client.is_alive


def test_a_core_that_cannot_start_raises_its_error(tiny_llama_checkpoint, tmp_path, monkeypatch):
    client = CoreProcessClient(build_config(model=str(tmp_path / "missing"), dtype="float32"))
    with pytest.raises(ValueError, match="missing"):
        client.start(timeout=120)
    assert client.process.poll() is not None
    # The same while the server is still sending a tokenizer larger than the socket's buffer: the core failed
    # before it read it, and the server gets its error, not a broken pipe or a hang.
    monkeypatch.setattr("pluginfer.text.tokenizer.native_tokenizer", lambda path: "x" * (8 << 20))
    client = CoreProcessClient(build_config(model=str(tmp_path / "missing"), dtype="float32"))
    with pytest.raises(ValueError, match="missing"):
        client.start(timeout=120)
    # Too small a KV cache for one sequence of max_model_len: both numbers and the flag to change.
    config = build_config(model=str(tiny_llama_checkpoint[0]), dtype="float32", **{"cache.kv_cache_memory": 4096})
    client = CoreProcessClient(config)
    with pytest.raises(ValueError, match=r"4096 bytes hold 0 tokens.*max_model_len 256 needs 256 tokens.*"
                                         r"--kv-cache-memory"):
        client.start(timeout=120)


def test_the_engine_loop_failing_in_the_core_is_sent_as_its_reason():
    """EngineCore's loop over a stand-in engine whose step raises: one Failure with the reason, exit 1."""

    class FailingEngine:
        failure = None

        def __init__(self) -> None:
            self.requests: list[str] = []

        def add_request(self, prompt, params, request_id, lora_request=None):  # noqa: ANN001, ANN202
            self.requests.append(request_id)

        def has_unfinished_requests(self) -> bool:
            return bool(self.requests)

        def step(self):  # noqa: ANN202
            raise RuntimeError("device lost")

        def stats(self) -> EngineStats:
            return EngineStats()

        def shutdown(self) -> None:
            pass

    ours, theirs = socket.socketpair()
    core = EngineCore(None, theirs)
    core.engine = FailingEngine()
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(core.run()))
    runner.start()
    ours.sendall(encode(AddRequest("r1", [1, 2], None)))
    runner.join(10)
    assert result == [1]
    ours.settimeout(10)
    assert FrameReader().feed(ours.recv(1 << 16)) == [Failure("RuntimeError: device lost")]
    ours.close()
    theirs.close()


def test_a_dead_engine_loop_reported_by_the_core_fails_requests(core_server):
    """The client's side of a Failure: the reason is the error, streams end with it."""
    client, server = core_server
    response = _open_stream(server)
    client._on_loop(client._dispatch, Failure("RuntimeError: device lost"))
    events = sse_events(response.read())
    assert events[-1] == "[DONE]" and "device lost" in events[-2]["error"]["message"]
    status, _, raw = http(server, "GET", "/health")
    assert status == 503 and "device lost" in raw.decode()


_SERVER_SCRIPT = """
import sys, time
from pluginfer.core.config import build_config
from pluginfer.server.core_client import CoreProcessClient
client = CoreProcessClient(build_config(model=sys.argv[1], dtype="float32", **{"cache.num_blocks": 32})).start()
print(client.process.pid, flush=True)
time.sleep(600)
"""


def test_the_core_does_not_outlive_a_killed_server(tiny_llama_checkpoint):
    server = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, str(tiny_llama_checkpoint[0])],
                              stdout=subprocess.PIPE, text=True)
    try:
        core = int(server.stdout.readline())
        assert not _gone(core)
        server.kill()
        server.wait(10)
        _wait_for(lambda: _gone(core), 20, "the core exited after its server was killed")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(child) for child in handle.read().split()]


def _serve(checkpoint: Path) -> tuple[subprocess.Popen, str, list[str]]:
    command = [sys.executable, "-m", "pluginfer", "serve", "--model", str(checkpoint), "--dtype", "float32",
               "--num-blocks", "64", "--block-size", "8", "--port", "0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(server.stderr), daemon=True).start()
    line = server.stdout.readline()
    assert "serving" in line, (line, "".join(stderr))
    return server, line.strip().rsplit(" ", 1)[1], stderr


@pytest.mark.slow
def test_pluginfer_serve_exits_1_when_its_engine_process_dies(tiny_llama_checkpoint):
    server, url, stderr = _serve(tiny_llama_checkpoint[0])
    try:
        (core,) = _children(server.pid)
        _wait_for(lambda: any(f"engine process {core} ready" in line for line in stderr), 10, "the start-up line")
        os.kill(core, signal.SIGKILL)
        _wait_for(lambda: any("the engine died" in line for line in stderr), 10, "the death reported")
        with pytest.raises(urllib.error.HTTPError) as answer:  # 503 while the server lingers for a second
            urllib.request.urlopen(url + "/health", timeout=5)
        assert answer.value.code == 503
        assert server.wait(timeout=30) == 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    text = "".join(stderr)
    assert f"the engine process (pid {core}) exited on signal SIGKILL" in text, text[-2000:]


@pytest.mark.slow
def test_pluginfer_serve_stopped_by_sigterm_takes_its_engine_process_along(tiny_llama_checkpoint):
    server, url, _ = _serve(tiny_llama_checkpoint[0])
    try:
        (core,) = _children(server.pid)
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            assert response.status == 200
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        _wait_for(lambda: _gone(core), 10, "the engine process exited with its server")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_malformed_frame_from_the_core_is_named_dropped_and_the_server_goes_on(core_server, caplog):
    """A frame that is not a message (an old core's string-tagged tuple, bytes that are no pickle) is one error
    line naming what it held; the frames after it read normally and the server keeps serving."""
    client, server = core_server
    caplog.set_level(logging.ERROR, logger="pluginfer.server.core_client")
    old = pickle.dumps(("out", [], (0, 0, 0.0, 0)))
    frames = [struct.pack(">I", len(old)) + old, struct.pack(">I", 12) + b"not a pickle",
              encode(Outputs([], EngineStats(num_blocks=NUM_BLOCKS, num_free_blocks=NUM_BLOCKS, num_preemptions=7)))]
    client._on_loop(client._receive, b"".join(frames))
    _wait_for(lambda: client.stats.num_preemptions == 7, 10, "the frame after the malformed ones read")
    errors = [r.getMessage() for r in caplog.records if "malformed frame" in r.getMessage()]
    assert len(errors) == 2 and "holds a tuple, not an engine message: ('out'" in errors[0], errors
    assert "does not decode" in errors[1] and "b'not a pickle'" in errors[1], errors
    assert http(server, "GET", "/health")[0] == 200 and client.is_alive
    status, _, raw = http(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3


def test_a_malformed_frame_from_the_server_is_named_and_the_core_goes_on(caplog):
    """The core's reader drops a frame that is no message (logging what it held) and applies the next ones."""

    class IdleEngine:
        failure = None

        def __init__(self) -> None:
            self.requests: list[str] = []

        def add_request(self, prompt, params, request_id, lora_request=None):  # noqa: ANN001, ANN202
            self.requests.append(request_id)

        def abort_request(self, request_id: str) -> None:
            self.requests.remove(request_id)

        def has_unfinished_requests(self) -> bool:
            return False  # never steps: the test is about reading

        def shutdown(self) -> None:
            pass

    caplog.set_level(logging.ERROR, logger="pluginfer.engine.engine_core")
    ours, theirs = socket.socketpair()
    core = EngineCore(None, theirs)
    core.engine = engine = IdleEngine()
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(core.run()))
    runner.start()
    junk = pickle.dumps({"add": "r0"})
    ours.sendall(struct.pack(">I", len(junk)) + junk + encode(AddRequest("r1", [1, 2], None)) + encode(Stop()))
    runner.join(10)
    assert result == [0] and engine.requests == ["r1"]
    assert any("malformed frame" in r.getMessage() and "holds a dict" in r.getMessage() for r in caplog.records)
    ours.close()
    theirs.close()
