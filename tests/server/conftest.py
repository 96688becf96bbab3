"""Servers on 127.0.0.1 (free ports, background threads) over the tiny random llama, and clients for them."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pluginfer.core.config import EngineConfig, build_config
from pluginfer.engine.async_engine import AsyncEngine
from pluginfer.engine.client import EngineClient, EngineStats
from pluginfer.engine.engine import LLMEngine
from pluginfer.server.core_client import CoreProcessClient
from pluginfer.server.launch import BackgroundServer

NUM_BLOCKS = 256
MODEL_NAME = "tiny-llama"
API_KEY = "sk-test-key"


def server_config(checkpoint: Path, **overrides: Any) -> EngineConfig:
    return build_config(model=str(checkpoint), dtype="float32", **{
        "cache.num_blocks": NUM_BLOCKS, "cache.block_size": 8, "server.port": 0,
        "server.served_model_name": MODEL_NAME, **overrides})


def start_engine(config: EngineConfig) -> AsyncEngine:
    return AsyncEngine(LLMEngine(config)).start()


def wait_until_idle(engine: EngineClient, timeout: float = 5.0) -> None:
    """Until no request is left and every KV block is free again (aborts land one step later), as the
    engine's stats say."""
    deadline = time.monotonic() + timeout
    while engine.num_requests or _busy(engine.stats):
        stats = engine.stats
        assert time.monotonic() < deadline, (
            f"not idle after {timeout}s: {engine.num_requests} requests, {stats.num_running} running, "
            f"{stats.num_waiting} waiting, {stats.num_free_blocks}/{stats.num_blocks} blocks free")
        time.sleep(0.01)


# A ChatML template that renders tools and tool calls as Hermes writes them.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}</tool_response>"
    "<|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _busy(stats: EngineStats) -> bool:
    return bool(stats.num_running or stats.num_waiting or stats.num_free_blocks != stats.num_blocks)


@pytest.fixture(scope="package", params=[1, 2, "core"], ids=["tp1", "tp2", "core"])
def async_engine(request, tiny_llama_checkpoint) -> Iterator[EngineClient]:
    """The shared engine: every server test runs on one rank, again on two tensor-parallel ranks
    (spawned processes over gloo), so the whole API is checked through the distributed engine, and
    again through the engine core process ``pluginfer serve`` runs (``CoreProcessClient``, one rank)."""
    if request.param == "core":
        engine = CoreProcessClient(server_config(tiny_llama_checkpoint[0])).start()
    else:
        engine = start_engine(server_config(tiny_llama_checkpoint[0],
                                            **{"parallel.tensor_parallel_size": request.param}))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="package")
def make_server(tiny_llama_checkpoint, async_engine) -> Iterator[Callable[..., BackgroundServer]]:
    """Servers over the shared engine with other server settings (``server.api_keys=[...]``)."""
    servers: list[BackgroundServer] = []

    def make(engine: EngineClient | None = None, **overrides: Any) -> BackgroundServer:
        config = server_config(tiny_llama_checkpoint[0], **overrides)
        servers.append(BackgroundServer(engine or async_engine, config))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="package")
def server(make_server) -> BackgroundServer:
    return make_server()


@pytest.fixture
def tool_template(async_engine) -> Iterator[None]:
    """TOOL_TEMPLATE in place of the tiny llama's own chat template, which renders no tools."""
    tokenizer = async_engine.tokenizer
    plain, tokenizer.chat_template = tokenizer.chat_template, TOOL_TEMPLATE
    yield
    tokenizer.chat_template = plain


@pytest.fixture(autouse=True)
def _engine_left_idle(request) -> Iterator[None]:
    """Every test leaves the shared engine with no request and every KV block free."""
    yield
    if "async_engine" in request.fixturenames or "server" in request.fixturenames:
        wait_until_idle(request.getfixturevalue("async_engine"))


def make_client(server: BackgroundServer, strict: bool = True, **kwargs: Any) -> openai.OpenAI:
    kwargs.setdefault("api_key", API_KEY)
    return openai.OpenAI(base_url=f"{server.url}/v1", max_retries=0, timeout=30,
                         _strict_response_validation=strict, **kwargs)


def make_async_client(server: BackgroundServer, strict: bool = True, **kwargs: Any) -> openai.AsyncOpenAI:
    kwargs.setdefault("api_key", API_KEY)
    kwargs.setdefault("timeout", 30)
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", max_retries=0,
                              _strict_response_validation=strict, **kwargs)


@pytest.fixture
def client(server) -> Iterator[openai.OpenAI]:
    with make_client(server) as client:
        yield client


@pytest.fixture
def lenient_client(server) -> Iterator[openai.OpenAI]:
    """For legacy completion streams, whose chunks carry finish_reason null (the client's type wants a value)."""
    with make_client(server, strict=False) as client:
        yield client


def http(server: BackgroundServer, method: str, path: str, body: Any = None, data: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """A raw request (stdlib only): (status, headers, body); 4xx and 5xx are returned, not raised."""
    headers = dict(headers or {})
    if body is not None:
        data = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(server.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def sse_events(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an event stream, JSON-decoded except the final "[DONE]"."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
