"""The aiohttp application: routes, API keys, request metrics, and the small endpoints."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import Any

from aiohttp import web

from pluginfer import __version__
from pluginfer.core.config import EngineConfig
from pluginfer.core.registry import get_registry
from pluginfer.engine.client import EngineClient
from pluginfer.server.access_log import access_log_middleware
from pluginfer.server.chat import create_chat_completion, render_prompt, template_kwargs
from pluginfer.server.chat_page import add_chat_page, is_public
from pluginfer.server.completions import create_completion
from pluginfer.server.cors import cors_middleware
from pluginfer.server.embeddings import create_embedding
from pluginfer.server.endpoints import ServerContext, attach_endpoints, builtin_routes
from pluginfer.server.errors import APIError, bad_request, error_middleware
from pluginfer.server.lora import adapter_cards, load_lora_adapter, unload_lora_adapter
from pluginfer.server.messages import count_message_tokens, create_message
from pluginfer.server.metrics import CONTENT_TYPE
from pluginfer.server.protocol import DetokenizeRequest, TokenizeRequest
from pluginfer.server.request_processors import RequestProcessors
from pluginfer.server.responses import RESPONSE_STORE, add_response_routes
from pluginfer.server.responses_store import ResponseStore
from pluginfer.server.score import add_score_routes
from pluginfer.server.state import STATE, ServerState, read_body
from pluginfer.server.streaming import CLIENT_LEFT
from pluginfer.server.tools import ToolCalling

_OPEN_PATHS = frozenset({"/health"})  # answered without an API key (load balancers' probes)


def build_app(engine: EngineClient, config: EngineConfig) -> web.Application:
    """The OpenAI-compatible app over a started engine client; ``config.server`` sets keys and limits.

    Run it with ``web.AppRunner(app, handler_cancellation=True)`` so a client that disconnects
    cancels its handler, which aborts its engine requests.
    """
    server = config.server
    access = [access_log_middleware()] if server.access_log else []
    app = web.Application(middlewares=[cors_middleware(server.allowed_origins), *access, _metrics_middleware,
                                       error_middleware, _auth_middleware(server.api_keys)],
                          client_max_size=server.max_request_bytes)
    app[STATE] = ServerState.create(engine, config)
    app[RESPONSE_STORE] = ResponseStore(server.responses_store_size)
    app.on_startup.append(_attach_engine)
    add_builtin_routes(app.router)
    registry, builtin = get_registry(), builtin_routes(app.router)
    attach_endpoints(app, server.endpoints, registry)  # plugins' routes: only those the config names
    app[STATE].processors = RequestProcessors.load(server.request_processors, registry,
                                                   lambda name: ServerContext(app, name, builtin))
    return app


def add_builtin_routes(router: web.UrlDispatcher) -> None:
    """The OpenAI API, the small endpoints and the chat page: the routes no endpoint plugin may take."""
    router.add_post("/v1/chat/completions", create_chat_completion)
    router.add_post("/v1/completions", create_completion)
    router.add_post("/v1/embeddings", create_embedding)
    router.add_post("/v1/messages", create_message)  # Anthropic's Messages API
    router.add_post("/v1/messages/count_tokens", count_message_tokens)
    add_response_routes(router)
    add_score_routes(router)
    router.add_get("/v1/models", list_models)
    router.add_get("/v1/models/{model_id:.+}", get_model)
    router.add_post("/tokenize", tokenize)
    router.add_post("/detokenize", detokenize)
    router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    router.add_get("/health", health)
    router.add_get("/metrics", metrics)
    router.add_get("/version", version)
    add_chat_page(router)


async def _attach_engine(app: web.Application) -> None:
    app[STATE].engine.attach()


@web.middleware
async def _metrics_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    counter = request.app[STATE].metrics.requests
    try:
        response = await handler(request)
    except (asyncio.CancelledError, ConnectionError):
        counter.labels(route, "499").inc()  # the client closed the connection first (nginx's code)
        raise
    counter.labels(route, "499" if request.get(CLIENT_LEFT) else str(response.status)).inc()
    return response


def _auth_middleware(api_keys: list[str]) -> Any:
    # Compared as SHA-256 digests, every key every time: the time taken says nothing of the keys or their lengths.
    keys = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    @web.middleware
    async def check_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if keys and request.path not in _OPEN_PATHS and not is_public(request.path):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # Anthropic's clients send the key as x-api-key.
            offered = [given if scheme.lower() == "bearer" else "", request.headers.get("x-api-key", "")]
            digests = [hashlib.sha256(key.strip().encode()).digest() for key in offered]
            matches = [hmac.compare_digest(digest, key) for digest in digests for key in keys]
            if not any(matches):
                raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>, or "
                               "x-api-key: <key>)", code="invalid_api_key")
        return await handler(request)

    return check_api_key


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "pluginfer",
            "root": state.root, "max_model_len": state.model_info.max_model_len,
            # token ids below it are valid prompts (`pluginfer bench serve`)
            "vocab_size": state.vocab_size,
            "sampling_defaults": state.sampling.model_dump()}  # what a request that sets none of them gets


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_card(state), *adapter_cards(state)]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = request.match_info["model_id"]
    state.check_model(model)
    card = next((card for card in adapter_cards(state) if card["id"] == model), None)
    return web.json_response(card or _model_card(state))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, TokenizeRequest)
    state.check_model(body.model)
    if body.tools and body.messages is None:
        raise bad_request("tools are rendered with messages; give messages", "tools")
    if body.messages is not None:
        tools = ToolCalling.from_request(body.tools, "none", None, None)  # validated as chat validates them
        tokens = render_prompt(state, [m.for_template() for m in body.messages], body.add_generation_prompt,
                               template_kwargs(state, body, tools))
    elif body.prompt is not None:
        tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise bad_request("give prompt or messages", "prompt")
    return web.json_response({"count": len(tokens), "max_model_len": state.model_info.max_model_len,
                              "tokens": tokens})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, DetokenizeRequest)
    state.check_model(body.model)
    vocab_size = state.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token ids must be in [0, {vocab_size}), got {bad[:5]}", "tokens")
    return web.json_response({"prompt": state.tokenizer.decode(body.tokens)})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.engine.is_alive:
        error = state.engine.error
        why = f": {type(error).__name__}: {error}" if error else ""
        raise APIError(503, f"the engine loop is not running{why}", code="engine_unavailable")
    if state.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})
