"""Faults through the server, in-process (AsyncEngine) and through the engine core process (CoreProcessClient).

A step that raises (injected with ``testing.fail_step_on_token_id``) is a 500 in OpenAI's shape for the
requests it ran and the server goes on; a request larger than the whole KV cache is a 400 at admission;
a KV cache too small for the load preempts and every request that fits still completes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket

import openai
import pytest

from pluginfer.server.core_client import CoreProcessClient
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import (
    MODEL_NAME,
    http,
    make_async_client,
    server_config,
    sse_events,
    start_engine,
    wait_until_idle,
)

FAULT = 7
NUM_BLOCKS = 12  # of 8 tokens: 96 tokens in all, less than the context (256)


@pytest.fixture(scope="module", params=["thread", "core"])
def small_server(request, tiny_llama_checkpoint):
    """A server whose engine has a 96-token KV cache and fails any step that computes token 7."""
    config = server_config(tiny_llama_checkpoint[0], **{"testing.fail_step_on_token_id": FAULT,
                                                        "cache.num_blocks": NUM_BLOCKS})
    engine = CoreProcessClient(config).start() if request.param == "core" else start_engine(config)
    server = BackgroundServer(engine, config)
    yield engine, server
    server.stop()
    engine.shutdown()


def _error(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _completion(server: BackgroundServer, prompt: list[int], max_tokens: int = 4, **fields) -> tuple[int, bytes]:
    """Greedy, never generating the faulty token (only a prompt holding it fails)."""
    status, _, raw = http(server, "POST", "/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logit_bias": {str(FAULT): -100}, **fields})
    return status, raw


def _texts(raw: bytes) -> list[str]:
    return [choice["text"] for choice in json.loads(raw)["choices"]]


@pytest.mark.parametrize("stream", [False, True])
def test_a_step_that_raises_is_a_500_and_the_server_goes_on(small_server, stream):
    engine, server = small_server
    expected = _texts(_completion(server, [30, 31, 32])[1])
    status, raw = _completion(server, [30, FAULT, 31], stream=stream)
    assert status == 500, raw
    error = _error(raw)
    assert error["type"] == "server_error" and error["code"] == "engine_step_failed"
    assert "injected fault" in error["message"]
    assert http(server, "GET", "/health")[0] == 200
    status, raw = _completion(server, [30, 31, 32])
    assert status == 200 and _texts(raw) == expected  # the same answer as before the fault
    wait_until_idle(engine)


def test_a_fault_after_a_stream_started_is_an_error_event(small_server):
    """The faulty token is generated, not in the prompt: the stream has started, so the 500 is its last event
    (through the engine core the first token may reach the handler together with the failure: then a 500)."""
    engine, server = small_server
    status, _, raw = http(server, "POST", "/v1/completions", {
        "model": MODEL_NAME, "prompt": [30, 31], "max_tokens": 1, "logit_bias": {str(FAULT): 100},
        "stream": True, "n": 2, "ignore_eos": True})
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1] if isinstance(e, dict))
    # A second token makes the next step compute token 7: it fails there.
    status, _, raw = http(server, "POST", "/v1/completions", {
        "model": MODEL_NAME, "prompt": [30, 31], "max_tokens": 3, "logit_bias": {str(FAULT): 100},
        "stream": True, "ignore_eos": True})
    if status == 500:  # the engine core's client coalesced the first token with the failure: no event was sent
        assert isinstance(engine, CoreProcessClient) and _error(raw)["code"] == "engine_step_failed"
    else:
        assert status == 200
        *chunks, error, done = sse_events(raw)
        assert chunks and done == "[DONE]"
        assert error["error"]["code"] == "engine_step_failed" and error["error"]["type"] == "server_error"
    assert _completion(server, [30, 31, 32])[0] == 200
    wait_until_idle(engine)


def test_a_request_larger_than_the_whole_cache_is_a_400(small_server):
    engine, server = small_server
    status, raw = _completion(server, list(range(10, 10 + NUM_BLOCKS * 8 + 1)))
    assert status == 400
    error = _error(raw)
    assert error["param"] == "prompt" and "KV cache" in error["message"], error
    assert _completion(server, [30, 31, 32])[0] == 200
    wait_until_idle(engine)


def test_kv_exhaustion_preempts_and_every_request_that_fits_completes(small_server):
    """16 requests of up to 40 + 40 tokens over a 96-token cache: they take turns, none fails."""
    engine, server = small_server
    prompts = [list(range(100 + i, 100 + i + 8 + 2 * i)) for i in range(16)]

    async def main() -> list:
        async with make_async_client(server) as client:
            return await asyncio.gather(*(client.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=40, temperature=0, logit_bias={str(FAULT): -100},
                extra_body={"ignore_eos": True})
                for p in prompts))

    replies = asyncio.run(main())
    assert [r.usage.completion_tokens for r in replies] == [40] * 16
    assert {r.choices[0].finish_reason for r in replies} == {"length"}
    wait_until_idle(engine)
    alone = [_texts(_completion(server, p, max_tokens=40)[1])[0] for p in prompts[:3]]
    assert [r.choices[0].text for r in replies[:3]] == alone  # preemption by recompute changes nothing
    assert engine.stats.num_preemptions > 0  # read through the client, wherever the engine runs


def test_the_openai_client_sees_a_500_as_an_internal_server_error(small_server):
    engine, server = small_server

    async def main() -> None:
        async with make_async_client(server) as client:
            with pytest.raises(openai.InternalServerError) as caught:
                await client.completions.create(model=MODEL_NAME, prompt=[FAULT], max_tokens=2)
            assert caught.value.body["code"] == "engine_step_failed"

    asyncio.run(main())
    wait_until_idle(engine)


def test_clients_leaving_mid_stream_are_499s_not_logged_errors(small_server, caplog):
    """Whether the server notices the closed connection by its handler being cancelled or by a write that
    fails, the request is aborted, counted as a 499, and nothing is logged as an error."""
    engine, server = small_server
    before = _count_499(server)
    body = json.dumps({"model": MODEL_NAME, "prompt": [30, 31], "max_tokens": 60, "stream": True, "n": 2,
                       "ignore_eos": True, "logit_bias": {str(FAULT): -100}}).encode()
    with caplog.at_level(logging.WARNING):
        for _ in range(10):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                received = b""
                while received.count(b"data: ") < 2:
                    received += sock.recv(4096)
        wait_until_idle(engine)
        assert _count_499(server) == before + 10
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def _count_499(server: BackgroundServer) -> float:
    text = http(server, "GET", "/metrics")[2].decode()
    found = re.search(r'^pluginfer_requests_total\{route="/v1/completions",status="499"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0
