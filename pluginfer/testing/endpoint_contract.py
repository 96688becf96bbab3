"""Conformance kit for endpoint and request processor plugins, and a server to run them end to end.

- ``check_endpoint(factory)``: the factory adds its routes through ``context.add_route`` only, none of
  them a built-in route's, each handler a coroutine function; returns the ``(method, path)`` it added.
- ``check_request_processor(processor, request, texts)``: ``preprocess`` keeps the request's endpoint,
  prompt count and ``SamplingParams``; ``postprocess`` of a growing output only grows.
- ``serve(model, engine_process=False, **settings)``: the model behind the OpenAI server on 127.0.0.1
  with ``server.endpoints`` / ``server.request_processors`` as given, its engine in a thread of this
  process or (``engine_process=True``) in an engine core process of its own, as ``pluginfer serve``
  runs it; yields the server (``.url``, ``.port``). A plugin's own tests send it real requests.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from aiohttp import web

from pluginfer.core.serving import EndpointContext, PromptRequest, RequestProcessor
from pluginfer.engine.sequence import SamplingParams
from pluginfer.server.app import add_builtin_routes
from pluginfer.server.endpoints import ServerContext, builtin_routes


def check_endpoint(factory: Callable[[EndpointContext], Any], name: str = "under-test") -> list[tuple[str, str]]:
    """Attach the endpoint to an app that holds the built-in routes (no engine behind it: the factory
    must not use the engine or the tokenizer until a request comes)."""
    app = web.Application()
    add_builtin_routes(app.router)
    before = {id(route) for route in app.router.routes()}
    factory(ServerContext(app, name, builtin_routes(app.router)))  # a built-in route's path raises here
    added = [route for route in app.router.routes() if id(route) not in before and route.method != "HEAD"]
    assert added, f"endpoint {name!r} added no route"
    for route in added:
        assert inspect.iscoroutinefunction(route.handler), \
            f"endpoint {name!r}: the handler of {route.method} {route.resource.canonical} must be async"
    return [(route.method, route.resource.canonical) for route in added]


def check_request_processor(processor: RequestProcessor, request: PromptRequest, texts: Sequence[str] = ()) -> PromptRequest:
    """``texts``: an output that grows one text after another; returns what ``preprocess`` made of ``request``."""
    after = processor.preprocess(request)
    assert isinstance(after, PromptRequest), f"preprocess returned {type(after).__name__}, not a PromptRequest"
    assert after.endpoint == request.endpoint, "preprocess must keep the endpoint"
    assert isinstance(after.params, SamplingParams), "preprocess must return SamplingParams as params"
    if request.prompts is not None:
        assert after.prompts is not None and len(after.prompts) == len(request.prompts), "the prompt count changed"
    if request.messages is not None:
        assert isinstance(after.messages, list) and after.messages, "preprocess must return messages"
    seen = ""
    for i, text in enumerate(texts):
        now = processor.postprocess(after, text, final=i == len(texts) - 1)
        assert isinstance(now, str) and now.startswith(seen), f"postprocess shrank {seen!r} to {now!r}"
        seen = now
    return after


@contextmanager
def serve(model: str, engine_process: bool = False, **settings: Any) -> Iterator[Any]:
    """A ``BackgroundServer`` over ``model`` (a checkpoint path) with ``settings`` as dotted config keys
    (``{"server.endpoints": ["echo"], "cache.num_blocks": 64}``); stopped, with its engine, on exit."""
    from pluginfer.core.config import build_config
    from pluginfer.engine.async_engine import AsyncEngine
    from pluginfer.engine.engine import LLMEngine
    from pluginfer.server.core_client import CoreProcessClient
    from pluginfer.server.launch import BackgroundServer

    config = build_config(model=model, **{"server.port": 0, **settings})
    engine = CoreProcessClient(config).start() if engine_process else AsyncEngine(LLMEngine(config)).start()
    try:
        server = BackgroundServer(engine, config)
        try:
            yield server
        finally:
            server.stop()
    finally:
        engine.shutdown()
