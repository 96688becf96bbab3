"""A Messages request whose engine step fails: a 500 in Anthropic's shape before the stream starts, an ``error``
event after it; the server goes on. The fault is a token the model writes (transformers' greedy continuation
says which), injected with ``testing.fail_step_on_token_id``."""

from __future__ import annotations

import json

import anthropic
import pytest
import torch

from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import MODEL_NAME, http, server_config, start_engine, wait_until_idle

TURNS = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def faulty(tiny_llama_checkpoint):
    """(server, engine, i): the engine fails the step that feeds back the i-th token it writes for TURNS."""
    path, model = tiny_llama_checkpoint
    probe = BackgroundServer(engine := start_engine(server_config(path)), server_config(path))
    prompt = json.loads(http(probe, "POST", "/tokenize", {"messages": TURNS})[2])["tokens"]
    probe.stop()
    engine.shutdown()
    with torch.inference_mode():
        written = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    # A token that is neither in the prompt nor written before it, from the third on: the stream has begun.
    index = next(i for i in range(2, len(written)) if written[i] not in prompt + written[:i])
    config = server_config(path, **{"testing.fail_step_on_token_id": written[index]})
    engine = start_engine(config)
    server = BackgroundServer(engine, config)
    yield server, engine, index
    server.stop()
    engine.shutdown()


def test_a_failed_step_is_an_anthropic_error_and_the_server_goes_on(faulty):
    server, engine, index = faulty
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": TURNS, "temperature": 0}
    status, _, raw = http(server, "POST", "/v1/messages", {**body, "stream": True})
    assert status == 200
    events = [block.split("\n", 1) for block in raw.decode().split("\n\n") if block]
    names = [name.removeprefix("event: ") for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "error"
    error = json.loads(events[-1][1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "injected fault" in error["error"]["message"]
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        with pytest.raises(anthropic.InternalServerError, match="injected fault"):
            client.messages.create(model=MODEL_NAME, max_tokens=8, messages=TURNS, extra_body={"temperature": 0})
        reply = client.messages.create(model=MODEL_NAME, max_tokens=index, messages=TURNS,
                                       extra_body={"temperature": 0})
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == index
    wait_until_idle(engine)
