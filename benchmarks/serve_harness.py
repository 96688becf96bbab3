"""serve_vs_llamacpp.py's harness: the servers it starts and watches (``Server``: started and timed to its first
ready answer; a free loopback port; the CPU a process tree uses while idle) and its streaming client: one streamed
``/v1/completions`` request through the official ``openai`` package (``stream_one``) or a minimal client
(``stream_one_raw``: about a third of the openai package's CPU per token), in waves, in a process of its own.

    python benchmarks/serve_harness.py URL CONCURRENCY REQUESTS GEN {openai,raw}   # one client run; prints JSON
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

PROMPT = "The quick brown fox jumps over the lazy dog; then it runs into the forest, where"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log: Path,
                 ready_path: str = "/health") -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.log = log.open("w")
        started = time.perf_counter()
        # Not in the checkout: `python -m` puts the working directory first on sys.path, before PYTHONPATH.
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=log.parent)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.process.returncode}; see {log}")
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        self.startup_s = time.perf_counter() - started

    def exit_description(self) -> str | None:
        """How the server's process ended ("exited on SIGSEGV", "exited with 1"); None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        if code < 0:
            try:
                return f"exited on {signal.Signals(-code).name}"
            except ValueError:
                return f"exited on signal {-code}"
        return f"exited with {code}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and all its descendants (Linux /proc), in seconds."""
    total, pending = 0.0, [pid]
    ticks = os.sysconf("SC_CLK_TCK")
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def idle_cpu(server: Server, seconds: float) -> float:
    """Cores the server (and its engine core) use while no request is in flight, over ``seconds``."""
    before = tree_cpu_seconds(server.process.pid)
    time.sleep(seconds)
    return (tree_cpu_seconds(server.process.pid) - before) / seconds


def load_average() -> float:
    return os.getloadavg()[0]



async def stream_one(client: object, i: int, gen: int) -> tuple[float, list[float], int]:
    """One streamed completion through an ``openai.AsyncOpenAI`` client: its start, the arrival time of each
    chunk with text, and the generated tokens (the usage chunk's count)."""
    started = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(
        model="m", prompt=f"{PROMPT} {i}", max_tokens=gen, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return started, stamps, tokens or len(stamps)


async def stream_one_raw(url: str, i: int, gen: int) -> tuple[float, list[float], int]:
    """The same completion as ``stream_one``, through a minimal client: HTTP/1.1 on an asyncio stream, the
    chunked body's ``data:`` lines parsed with ``json.loads``; a fraction of the ``openai`` client's CPU per
    token, so that on a 2-core machine the client takes less of the cores from the server it measures."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "m", "prompt": f"{PROMPT} {i}", "max_tokens": gen, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {head.splitlines()[0]!r}")
    chunked = b"transfer-encoding: chunked" in head.lower()
    stamps, tokens, pending = [], 0, b""
    while True:
        if chunked:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            data = data[:-2]
            if not size:
                break
        else:
            data = await reader.read(1 << 16)
            if not data:
                break
        arrived = time.perf_counter()
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            choices = event.get("choices")
            if choices and choices[0].get("text"):
                stamps.append(arrived)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    writer.close()
    return started, stamps, tokens or len(stamps)


async def client_run(url: str, concurrency: int, requests: int, gen: int, kind: str = "openai") -> dict[str, float]:
    if kind == "raw":
        async def one(i: int) -> tuple[float, list[float], int]:
            return await stream_one_raw(url, i, gen)
        return await _client_waves(one, concurrency, requests)
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        async def one(i: int) -> tuple[float, list[float], int]:
            return await stream_one(client, i, gen)
        return await _client_waves(one, concurrency, requests)


async def _client_waves(one: Any, concurrency: int, requests: int) -> dict[str, float]:
    """A warm-up request, then ``requests`` in waves of ``concurrency``: median TTFT and ITL, tokens/s."""
    await one(-1)
    started = time.perf_counter()
    results = []
    for wave in range(max(1, requests // concurrency)):
        results += await asyncio.gather(*(one(wave * concurrency + i) for i in range(concurrency)))
    wall = time.perf_counter() - started
    gaps = [b - a for _, stamps, _ in results for a, b in zip(stamps, stamps[1:])]
    return {"ttft_ms": statistics.median(stamps[0] - t0 for t0, stamps, _ in results if stamps) * 1e3,
            "itl_ms": statistics.median(gaps) * 1e3,
            "tok_s": sum(tokens for _, _, tokens in results) / wall}


def run_client(url: str, concurrency: int, requests: int, gen: int, kind: str = "openai") -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, url, str(concurrency), str(requests), str(gen), kind],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit(print(__doc__))
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    url, concurrency, requests, gen, kind = sys.argv[1:6]
    print(json.dumps(asyncio.run(client_run(url, int(concurrency), int(requests), int(gen), kind))))
