"""The serving benchmarks' client: one streamed ``/v1/completions`` request through the official ``openai``
package (``stream_one``) or through a minimal client (``stream_one_raw``: HTTP/1.1 on an asyncio stream,
``json.loads`` per event, about a third of the openai package's CPU per token), and runs of them in waves.

    python benchmarks/serve_client.py URL CONCURRENCY REQUESTS GEN {openai,raw}   # one run; prints JSON

``run_client`` runs that in a child process, so the client's CPU is its own process's (serve_vs_llamacpp.py).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPT = "The quick brown fox jumps over the lazy dog; then it runs into the forest, where"


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
