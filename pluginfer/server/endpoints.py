"""Endpoint plugins: the routes ``server.endpoints`` names, added beside the built-in ones.

Each selected endpoint's factory gets a ``ServerContext`` (the ``pluginfer.core.serving.EndpointContext``
contract): the engine the handlers use, the tokenizer, the config, and ``add_route``, which refuses a
method and path a built-in route answers. A selected endpoint that cannot be imported or whose factory
raises stops the server from starting, naming it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pluginfer.core.config import EngineConfig
from pluginfer.core.registry import PluginError, Registry
from pluginfer.core.serving import ServingEngine
from pluginfer.server.errors import APIError
from pluginfer.server.state import STATE, ServerState


class RouteConflictError(PluginError):
    """An endpoint plugin's route has the method and path of a built-in route."""


class ServerContext:
    """What an endpoint or request processor plugin named ``plugin`` gets of the server."""

    def __init__(self, app: web.Application, plugin: str, builtin: list[tuple[str, dict[str, Any]]]) -> None:
        self._app, self._plugin, self._builtin = app, plugin, builtin

    @property
    def _state(self) -> ServerState:
        if STATE not in self._app:
            raise RuntimeError(f"endpoint {self._plugin!r}: no engine behind this context yet (a conformance check, "
                               "or the factory itself): use the engine and tokenizer in request handlers")
        return self._app[STATE]

    @property
    def engine(self) -> ServingEngine:
        return self._state.engine

    @property
    def tokenizer(self) -> Any:
        return self._state.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self._state.config

    @property
    def model_name(self) -> str:
        return self._state.model_name

    def add_route(self, method: str, path: str, handler: Callable[[web.Request], Awaitable[Any]]) -> None:
        method = method.upper()
        for taken, info in self._builtin:
            if method in (taken, "*") or taken == "*" or (method == "GET" and taken == "HEAD"):
                if _answers(info, path):
                    raise RouteConflictError(f"endpoint {self._plugin!r}: the route {method} {path} is a built-in route's; "
                                     "choose another path")
        self._app.router.add_route(method, path, handler)

    def error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> Exception:
        return APIError(status, message, param, code)


def _answers(info: dict[str, Any], path: str) -> bool:
    """Whether a built-in resource (its ``get_info()``) answers ``path``."""
    if "path" in info:
        return info["path"] == path
    if "pattern" in info:
        return info["pattern"].fullmatch(path) is not None
    if "prefix" in info:
        return path == info["prefix"] or path.startswith(info["prefix"].rstrip("/") + "/")
    return False


def builtin_routes(router: web.UrlDispatcher) -> list[tuple[str, dict[str, Any]]]:
    """(method, resource info) of every route of ``router`` so far: the built-in ones."""
    return [(route.method, route.resource.get_info()) for route in router.routes() if route.resource is not None]


def attach_endpoints(app: web.Application, names: list[str], registry: Registry) -> None:
    """Add the routes of each endpoint plugin in ``names``; any failure is a start-up error naming it."""
    builtin = builtin_routes(app.router)
    for name in names:
        factory = registry.load("endpoint", name)
        try:
            factory(ServerContext(app, name, builtin))
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"endpoint {name!r} failed to add its routes: {type(exc).__name__}: {exc}") from exc
