"""SIGTERM with ``--shutdown-timeout``: the requests in flight finish, new ones get a 503, the server exits 0.

(Without it, SIGTERM ends them at once: tests/server/test_disconnects.py::test_a_signal_stops_the_server_cleanly.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.server.conftest import MODEL_NAME, sse_events


def _serve(checkpoint, *flags: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "pluginfer", "serve", "--model", str(checkpoint), "--port", "0", "--dtype", "float32",
         "--num-blocks", "256", "--block-size", "8", "--served-model-name", MODEL_NAME, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = process.stdout.readline()
    if "serving" not in line:
        process.kill()
        pytest.fail(f"no server: {line} {process.stderr.read()}")
    return process, line.split(" on ")[-1].strip()


@pytest.mark.parametrize("engine_process", ["1", "0"], ids=["core", "thread"])
def test_sigterm_drains_the_requests_in_flight_then_exits_0(tiny_llama_checkpoint, engine_process, monkeypatch):
    monkeypatch.setenv("PLUGINFER_ENGINE_PROCESS", engine_process)
    process, url = _serve(tiny_llama_checkpoint[0], "--shutdown-timeout", "120")
    try:
        body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 240, "ignore_eos": True,
                           "stream": True, "n": 8}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            first = response.readline() + response.readline()
            process.send_signal(signal.SIGTERM)
            try:  # while it drains, new work is refused (if the stream is still running when this arrives)
                urllib.request.urlopen(f"{url}/health", timeout=10)
                health = 200
            except urllib.error.HTTPError as error:
                health = error.code
            except urllib.error.URLError:
                health = None  # already drained and closed
            rest = response.read()
        assert health in (503, None)
        events = sse_events(first + rest)
        assert events[-1] == "[DONE]"
        chunks = [event for event in events[:-1]]
        assert all("error" not in chunk for chunk in chunks), chunks[-1]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert sorted(finishes) == ["length"] * 8  # every choice ran to its max_tokens
        assert process.wait(timeout=60) == 0
        assert "draining 1 request(s) in flight" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_drain_ends_at_its_deadline_with_requests_still_running(capsys):
    """A request that would never finish does not hold the shutdown: the drain returns at its deadline."""
    from aiohttp import web

    from pluginfer.server.launch import _drain
    from pluginfer.server.state import STATE

    class NeverIdle:
        num_requests = 1
        is_alive = True

    app = web.Application()
    app[STATE] = type("State", (), {"draining": False})()
    asyncio.run(_drain(app, NeverIdle(), 0.2))
    assert app[STATE].draining
    err = capsys.readouterr().err
    assert "draining 1 request(s) in flight for at most 0.2 s" in err and "1 request(s) still in flight are ended" in err
