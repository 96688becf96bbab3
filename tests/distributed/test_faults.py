"""A rank that dies: detected within seconds, requests end with an error, the server exits non-zero.

Never a hang: each wait below is bounded, and the bounds are failures, not measurements.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from pluginfer import LLM, SamplingParams

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(child) for child in handle.read().split()]


def test_engine_reports_a_lost_rank(tiny_llama_checkpoint) -> None:
    llm = LLM(str(tiny_llama_checkpoint[0]), dtype="float32", num_blocks=32, block_size=8, tensor_parallel_size=2)
    try:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
        (worker,) = [process.pid for _, process in llm.engine.executor.local_workers.processes]
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while llm.engine.failure is None:
            assert time.monotonic() < deadline, "the lost rank was not noticed"
            time.sleep(0.05)
        assert f"rank 1 (pid {worker}) exited" in llm.engine.failure
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        llm.close()


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_server_survives_nothing_of_a_killed_worker_mid_stream(tiny_llama_checkpoint) -> None:
    """Kill rank 1 while a stream runs: the stream ends with an error event, /health turns 503, the
    server prints one line naming the rank and exits 1."""
    command = [sys.executable, "-m", "pluginfer", "serve", "--model", str(tiny_llama_checkpoint[0]),
               "--dtype", "float32", "--num-blocks", "64", "--block-size", "8", "--port", "0",
               "--tensor-parallel-size", "2", "--distributed-timeout", "30"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr_lines: list[str] = []
    threading.Thread(target=lambda: stderr_lines.extend(server.stderr), daemon=True).start()
    try:
        line = server.stdout.readline()
        assert "serving" in line, (line, "".join(stderr_lines))
        url = line.strip().rsplit(" ", 1)[1]
        assert _get(url + "/health") == 200
        body = json.dumps({"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        events: list[str] = []
        with urllib.request.urlopen(request, timeout=30) as response:
            first = response.readline().decode()
            assert first.startswith("data: ")
            (worker,) = _children(server.pid)
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            for raw in response:  # the stream must end, not hang
                if raw.strip():
                    events.append(raw.decode().strip())
        assert time.monotonic() - killed < 20
        assert any('"error"' in event for event in events), events[-3:]
        assert _get(url + "/health") == 503  # answered during the second before the server exits
        assert server.wait(timeout=30) == 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    text = "".join(stderr_lines)
    assert f"rank 1 (pid {worker}) exited" in text, text[-2000:]
