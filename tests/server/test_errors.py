"""Every 4xx in the OpenAI shape, naming the field at fault; the server keeps answering afterwards."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pluginfer.server.errors import error_middleware
from tests.server.conftest import (
    API_KEY,
    MODEL_NAME,
    http,
    make_client,
    server_config,
    sse_events,
    start_engine,
    wait_until_idle,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG_PROMPT = list(range(10, 310))  # 300 tokens; the tiny llama's context is 256


def _error(status: int, raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/chat/completions", {"seed": 2**63}, "seed"),
    ("/v1/chat/completions", {"seed": -(2**63) - 1}, "seed"),
    ("/v1/chat/completions", {"temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # the template
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"stop": [""]}, "stop"),
    ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"top_k": 2**70}, "top_k"),  # would overflow the sampler's int64 tensor
    ("/v1/chat/completions", {"repetition_penalty": 1e-300}, "repetition_penalty"),  # would overflow logits
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_bad_fields_are_400_naming_the_field(server, path, fields, param):
    body = {**(CHAT if path.endswith("chat/completions") else {}), **fields}
    status, _, raw = http(server, "POST", path, body)
    assert status == 400, raw
    error = _error(400, raw)
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"max_tokens": 5.0}, "max_tokens"),
    ("/v1/chat/completions", {"n": "2"}, "n"),
    ("/v1/chat/completions", {"temperature": True}, "temperature"),
    ("/v1/chat/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"seed": 3.0}, "seed"),
    ("/v1/chat/completions", {"stop": ["x", 1]}, "stop.1"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": 7}]}, "messages.0.name"),
    ("/v1/chat/completions", {"parallel_tool_calls": "false"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": "true"}}}, "response_format.json_schema.strict"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": ["a"], "disable_any_whitespace": 1}},
     "structured_outputs.disable_any_whitespace"),
    ("/v1/completions", {"prompt": "hi", "echo": "true"}, "echo"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1.0}, "logprobs"),
])
def test_types_are_strict_as_openai_checks_them(server, path, fields, param):
    """No coercion: a string for a boolean or number, a float for an integer, a boolean for a number are 400s."""
    body = {**(CHAT if path.endswith("chat/completions") else {}), **fields}
    status, _, raw = http(server, "POST", path, body)
    assert status == 400, raw
    error = _error(400, raw)
    assert error["param"] == param and param.rpartition(".")[2] in error["message"], error


def test_an_integer_is_a_float(client):
    """temperature 0 and 1, top_p 1, logit_bias values as integers: accepted, as OpenAI accepts them."""
    for temperature in (0, 1):
        response = client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=2,
                                                  temperature=temperature, top_p=1, presence_penalty=0,
                                                  logit_bias={"5": 1}, seed=1)
        assert response.choices[0].finish_reason == "length"


def test_temperatures_too_small_for_float32_are_greedy(server, client):
    """1e-40 would turn the logits into inf and fail the whole batch's step; it is served as greedy."""
    greedy = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, temperature=0)
    tiny = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, temperature=1e-40)
    assert tiny.choices[0].text == greedy.choices[0].text
    assert http(server, "GET", "/health")[0] == 200


def test_prompt_longer_than_the_context_says_the_lengths(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi " * 300}])
    assert "256" in caught.value.message and "tokens" in caught.value.message
    assert caught.value.param == "messages"
    with pytest.raises(openai.BadRequestError):  # a stream fails before its first event: still a 400
        client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, stream=True)


@pytest.mark.parametrize(("data", "content_type"), [
    (b"{not json", "application/json"), (b"[1, 2]", "application/json"), (b"\xff\xfe", "application/json"),
    (b'{"temperature": NaN}', "application/json"), (b'{"messages": []}', "text/plain"), (b"", "application/json"),
])
def test_bodies_that_are_not_a_json_object_are_400(server, data, content_type):
    status, _, raw = http(server, "POST", "/v1/chat/completions", data=data,
                          headers={"Content-Type": content_type})
    assert status == 400 and _error(400, raw)["message"]


def test_unknown_model_and_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=CHAT["messages"])
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    for method, path in [("GET", "/v1/nothing"), ("POST", "/v2/chat/completions")]:
        status, _, raw = http(server, method, path, {})
        assert status == 404 and _error(404, raw)["code"] == "not_found"
    status, _, raw = http(server, "GET", "/v1/chat/completions")
    assert status == 405 and _error(405, raw)


def test_oversized_body_is_413(make_server):
    small = make_server(**{"server.max_request_bytes": 2048})
    status, _, raw = http(small, "POST", "/v1/completions", {"prompt": "x" * 4096})
    assert status == 413 and _error(413, raw)["code"] == "request_too_large"
    status, _, _ = http(small, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 200


def test_api_keys(make_server):
    keyed = make_server(**{"server.api_keys": ["other-key", API_KEY]})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, _, raw = http(keyed, "GET", "/v1/models", headers=headers)
        assert status == 401 and _error(401, raw)["code"] == "invalid_api_key"
    with make_client(keyed, api_key="wrong") as client, pytest.raises(openai.AuthenticationError):
        client.models.list()
    with make_client(keyed) as client:
        assert [m.id for m in client.models.list().data] == [MODEL_NAME]
        reply = client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=2)
        assert reply.choices[0].finish_reason in ("stop", "length")
    assert http(keyed, "GET", "/health")[0] == 200  # the only route open without a key
    for path in ("/metrics", "/version", "/v1/models/tiny-llama", "/no-such-route"):
        status, _, raw = http(keyed, "GET", path)
        assert status == 401 and _error(401, raw)["code"] == "invalid_api_key", path
        assert http(keyed, "GET", path, headers={"Authorization": f"Bearer {API_KEY}"})[0] in (200, 404)
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        assert http(keyed, "POST", path, {})[0] == 401, path


def test_too_many_waiting_is_429(tiny_llama_checkpoint, make_server):
    """One sequence runs at a time and one may wait: a third request is refused until they are done.

    The engine holds after each step until the test lets it go, so the running request cannot finish
    (and the waiting one cannot start) before the third is refused, however slow or fast the machine."""
    engine = start_engine(server_config(tiny_llama_checkpoint[0], **{"scheduler.max_num_seqs": 1}))
    step, go_on = engine.engine.step, threading.Event()
    engine.engine.step = lambda: (step(), go_on.wait(60))[0]  # this engine only
    busy = make_server(engine, **{"server.max_waiting": 1})
    long = {"prompt": "hello", "max_tokens": 5, "ignore_eos": True}
    short = {"prompt": "hello", "max_tokens": 1}
    runner = threading.Thread(target=http, args=(busy, "POST", "/v1/completions", long))
    waiter = threading.Thread(target=http, args=(busy, "POST", "/v1/completions", short))
    try:
        with make_client(busy) as client:
            runner.start()
            _wait_for(lambda: engine.engine.scheduler.num_running)  # stats come after the held step
            waiter.start()
            _wait_for(lambda: engine.num_waiting)
            with pytest.raises(openai.RateLimitError) as caught:
                client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
            assert caught.value.code == "rate_limit_exceeded"
            go_on.set()
            runner.join()
            waiter.join()
            assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1).choices
        wait_until_idle(engine)
    finally:
        go_on.set()
        engine.shutdown()


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def test_unexpected_exceptions_are_500_in_the_same_shape():
    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    async def main() -> tuple[int, dict]:
        app = web.Application(middlewares=[error_middleware])
        app.router.add_get("/boom", boom)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            response = await client.get("/boom")
            return response.status, await response.json()

    status, body = asyncio.run(main())
    assert status == 500 and body["error"]["type"] == "server_error" and "a bug" in body["error"]["message"]


def test_server_still_answers_after_all_that(server, client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=2)
    assert reply.usage.completion_tokens <= 2
    status, _, raw = http(server, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and sse_events(raw)[-1] == "[DONE]"
