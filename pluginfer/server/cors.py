"""CORS, off unless ``server.allowed_origins`` names origins (or ``*``): then browsers on those origins may
call the API. A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin is
answered here, before the API key is checked (browsers send no credentials on a preflight)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

_METHODS = "GET, POST, OPTIONS"
_MAX_AGE = "600"


def cors_middleware(allowed_origins: list[str]) -> Any:
    """The middleware for these origins; with none it adds nothing to any response."""
    allowed = frozenset(allowed_origins)
    any_origin = "*" in allowed

    def permits(origin: str | None) -> bool:
        return origin is not None and (any_origin or origin in allowed)

    @web.middleware
    async def cors(request: web.Request, handler: Any) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if not allowed or not permits(origin):
            return await handler(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            response: web.StreamResponse = web.Response(status=204)
            response.headers["Access-Control-Allow-Methods"] = _METHODS
            response.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "Access-Control-Request-Headers", "Authorization, Content-Type")
            response.headers["Access-Control-Max-Age"] = _MAX_AGE
        else:
            response = await handler(request)
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"
        return response

    return cors
