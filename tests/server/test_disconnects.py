"""Clients that go away, many at once; an engine that dies; a server stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from tests.server.conftest import (
    MODEL_NAME,
    http,
    make_async_client,
    make_client,
    server_config,
    sse_events,
    start_engine,
    wait_until_idle,
)

LONG = {"max_tokens": 200, "extra_body": {"ignore_eos": True}}


def test_clients_that_time_out_abort_their_requests(server, async_engine):
    """200 requests whose clients give up after 0.2 s; then the server answers at once, every block free.

    0.2 s, not more: through the engine-core process 200 tokens of the tiny model can finish within 0.5 s
    (87 of 200 did on a loaded 2-core machine), and the point is the abort path, not the speed."""

    async def give_up(client: openai.AsyncOpenAI, i: int) -> bool:
        messages = [{"role": "user", "content": f"request {i}"}]
        try:
            if i % 2:  # streaming: read until the client's own deadline
                async def read() -> None:
                    stream = await client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                                  stream=True, **LONG)
                    async for _ in stream:
                        pass
                await asyncio.wait_for(read(), 0.2)
            else:  # the HTTP client's read timeout
                await client.completions.create(model=MODEL_NAME, prompt=f"request {i}", **LONG)
        except (openai.APITimeoutError, asyncio.TimeoutError):
            return True
        return False

    async def main() -> int:
        timed_out = 0
        async with make_async_client(server, timeout=0.2) as client:
            for wave in range(4):  # a bounded loop: 4 waves of 50
                results = await asyncio.gather(*(give_up(client, 50 * wave + i) for i in range(50)))
                timed_out += sum(results)
        return timed_out

    assert asyncio.run(main()) >= 150  # a request may finish within 0.2 s; most cannot
    start = time.monotonic()
    with make_client(server) as client:
        reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert time.monotonic() - start < 5
    wait_until_idle(async_engine)


def test_concurrent_streams_equal_each_prompt_run_alone(server):
    prompts = [f"prompt number {i} says" + " more" * (i % 5) for i in range(32)]
    params = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    with make_client(server) as client:
        alone = [client.completions.create(prompt=p, **params).choices[0].text for p in prompts]

    async def stream(client: openai.AsyncOpenAI, prompt: str) -> str:
        messages = await client.completions.create(prompt=prompt, stream=True, **params)
        return "".join([chunk.choices[0].text async for chunk in messages if chunk.choices])

    async def main() -> list[str]:
        async with make_async_client(server, strict=False) as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts))

    assert asyncio.run(main()) == alone


def test_a_dead_engine_loop_is_503_and_ends_open_streams(tiny_llama_checkpoint, make_server):
    engine = start_engine(server_config(tiny_llama_checkpoint[0]))
    step, steps = engine.engine.step, []

    def failing_step():
        steps.append(None)
        if len(steps) > 3:
            raise RuntimeError("device lost")
        return step()

    engine.engine.step = failing_step
    doomed = make_server(engine)
    try:
        assert http(doomed, "GET", "/health")[0] == 200
        body = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
        status, _, raw = http(doomed, "POST", "/v1/completions", body)
        assert status == 200  # the stream had started: the error is its last event
        *chunks, error, done = sse_events(raw)
        assert chunks and done == "[DONE]" and "device lost" in error["error"]["message"]
        status, _, raw = http(doomed, "GET", "/health")
        assert status == 503 and "device lost" in raw.decode()
        status, _, _ = http(doomed, "POST", "/v1/completions", {"prompt": "hi"})
        assert status == 503
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_cleanly(tiny_llama_checkpoint, tmp_path, stop_signal):
    config = tmp_path / "deploy.yaml"
    config.write_text(f"model: {tiny_llama_checkpoint[0]}\ndtype: float32\ncache:\n  num_blocks: 64\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "pluginfer", "serve", "--config", str(config), "--port", "0",
         "--served-model-name", MODEL_NAME, "--api-key", "k1", "--block-size", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = process.stdout.readline()
        assert "serving" in line, (line, process.stderr.read() if process.poll() is not None else "")
        url = line.split(" on ")[-1].strip()
        with openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0, timeout=30) as client:
            assert [m.id for m in client.models.list().data] == [MODEL_NAME]
            stream = client.chat.completions.create(model=MODEL_NAME, stream=True, **LONG,
                                                    messages=[{"role": "user", "content": "hi"}])
            next(iter(stream))
            process.send_signal(stop_signal)
            with pytest.raises(openai.APIError):  # the stream ends with an error event, not a hang
                for _ in stream:
                    pass
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
