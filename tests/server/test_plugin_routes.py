"""Endpoint and request processor plugins in a running server: routes only where the config names them,
collisions with built-in routes and broken plugins stop the start-up naming the plugin, and a failing
processor is its request's 500 in the API's error shape, never the server's end."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from pluginfer.core.hookspecs import EndpointSpec, RequestProcessorSpec, hookimpl
from pluginfer.core.registry import BrokenPluginError, UnknownPluginError, get_registry
from pluginfer.core.serving import EndpointContext, PromptRequest
from pluginfer.engine.async_engine import AsyncEngine
from pluginfer.engine.engine import LLMEngine
from pluginfer.server.endpoints import RouteConflictError
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import http, server_config, sse_events

CLASHES = {"clash-chat": ("POST", "/v1/chat/completions"), "clash-model": ("GET", "/v1/models/mine"),
           "clash-static": ("GET", "/static/mine.js"), "clash-page": ("GET", "/")}


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"hello": request.match_info.get("who", "world")})


def attach_hello(context: EndpointContext) -> None:
    context.add_route("GET", "/v1/hello/{who}", hello)
    context.add_route("POST", "/v1/models", hello)  # another method of a built-in path is free


def attach_clash(name: str):
    def attach(context: EndpointContext) -> None:
        context.add_route(*CLASHES[name], hello)
    return attach


class Failing:
    """Raises in the step the prompt names: ``pre``, or ``post`` once the output is final."""

    def preprocess(self, request: PromptRequest) -> PromptRequest:
        if "fail-pre" in (request.prompts or [""])[0]:
            raise ValueError("cannot read this prompt")
        return request

    def postprocess(self, request: PromptRequest, text: str, final: bool) -> str:
        if "fail-post" in (request.prompts or [""])[0] and final:
            raise KeyError("lost")
        return text


class Plugin:
    @hookimpl
    def pluginfer_endpoints(self) -> list[EndpointSpec]:
        specs = [EndpointSpec(name="hello", factory=f"{__name__}:attach_hello"),
                 EndpointSpec(name="missing", factory="tests_no_such_module:attach")]
        return specs + [EndpointSpec(name=name, factory=f"{__name__}:CLASH_FACTORIES.{name.replace('-', '_')}")
                        for name in CLASHES]

    @hookimpl
    def pluginfer_request_processors(self) -> list[RequestProcessorSpec]:
        return [RequestProcessorSpec(name="failing", factory=f"{__name__}:build_failing")]


CLASH_FACTORIES = type("ClashFactories", (), {name.replace("-", "_"): staticmethod(attach_clash(name))
                                              for name in CLASHES})


def build_failing(context: EndpointContext) -> Failing:
    return Failing()


@pytest.fixture(scope="module")
def engine(tiny_llama_checkpoint):
    registry = get_registry()
    registry.register(Plugin(), name="route-tests")
    engine = AsyncEngine(LLMEngine(server_config(tiny_llama_checkpoint[0]))).start()
    yield engine
    engine.shutdown()
    registry.unregister("route-tests")


def start(engine, checkpoint, **overrides) -> BackgroundServer:
    return BackgroundServer(engine, server_config(checkpoint, **overrides))


def test_routes_come_only_from_the_endpoints_the_config_names(engine, tiny_llama_checkpoint) -> None:
    plain = start(engine, tiny_llama_checkpoint[0])
    hello_server = start(engine, tiny_llama_checkpoint[0], **{"server.endpoints": ["hello"]})
    try:
        assert http(plain, "GET", "/v1/hello/you")[0] == 404
        status, _, body = http(hello_server, "GET", "/v1/hello/you")
        assert (status, json.loads(body)) == (200, {"hello": "you"})
        assert json.loads(http(hello_server, "GET", "/v1/models")[2])["object"] == "list"  # the built-in GET stays
        assert json.loads(http(hello_server, "POST", "/v1/models", {})[2]) == {"hello": "world"}
    finally:
        plain.stop()
        hello_server.stop()


@pytest.mark.parametrize("name", list(CLASHES))
def test_a_route_of_a_built_in_is_a_start_up_error_naming_the_endpoint(engine, tiny_llama_checkpoint, name) -> None:
    method, path = CLASHES[name]
    with pytest.raises(RouteConflictError, match=f"endpoint '{name}': the route {method} {path} is a built-in"):
        start(engine, tiny_llama_checkpoint[0], **{"server.endpoints": [name]})


def test_a_broken_or_unknown_endpoint_stops_the_start_up(engine, tiny_llama_checkpoint) -> None:
    with pytest.raises(BrokenPluginError, match="plugin route-tests .*cannot import factory 'tests_no_such_module:"
                                                "attach' of endpoint 'missing'"):
        start(engine, tiny_llama_checkpoint[0], **{"server.endpoints": ["missing"]})
    with pytest.raises(UnknownPluginError, match="no endpoint plugin named 'nope'; available: .*hello"):
        start(engine, tiny_llama_checkpoint[0], **{"server.endpoints": ["nope"]})


def test_a_failing_processor_is_a_500_of_its_request_and_the_server_goes_on(engine, tiny_llama_checkpoint) -> None:
    server = start(engine, tiny_llama_checkpoint[0], **{"server.request_processors": ["failing"]})
    body = {"prompt": "fail-pre here", "max_tokens": 4}
    try:
        status, _, raw = http(server, "POST", "/v1/completions", body)
        assert status == 500 and json.loads(raw) == {"error": {
            "message": "request processor 'failing' failed: preprocess raised ValueError: cannot read this prompt",
            "type": "server_error", "param": None, "code": "request_processor_failed"}}
        status, _, raw = http(server, "POST", "/v1/completions", {**body, "prompt": "fail-post here"})
        assert status == 500 and "postprocess raised KeyError: 'lost'" in json.loads(raw)["error"]["message"]
        status, _, raw = http(server, "POST", "/v1/completions", {**body, "prompt": "fail-post", "stream": True})
        *events, done = sse_events(raw)
        assert status == 200 and done == "[DONE]" and events[0]["choices"]  # begun: the error is its last event
        assert events[-1]["error"]["code"] == "request_processor_failed"
        status, _, raw = http(server, "POST", "/v1/completions", {**body, "prompt": "fine"})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
