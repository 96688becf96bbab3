"""What the server gives an HTTP endpoint plugin and asks of a request processor plugin.

``EndpointContext`` is handed to the factories of both kinds (``pluginfer_endpoints``,
``pluginfer_request_processors``) when the server starts. ``PromptRequest`` is what a request
processor sees of a chat or completions request before it is tokenized.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pluginfer.core.config import EngineConfig


class ServingEngine(Protocol):
    """The engine as the server's handlers use it (``AsyncEngine`` in process, ``EngineClient`` across)."""

    def generate(self, prompt: str | list[int], params: Any, request_id: str | None = None) -> AsyncIterator[Any]:
        """Start a request (``params``: ``pluginfer.SamplingParams``) and yield its ``RequestOutput`` as it
        grows; the last one has ``finished`` True. Closing the iterator early aborts the request."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request started by ``generate``; its KV blocks are freed."""
        ...


class EndpointContext(Protocol):
    """The server an endpoint or request processor plugs into."""

    @property
    def engine(self) -> ServingEngine:
        """The engine the built-in handlers talk to."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer: ``encode(text, add_special_tokens=True) -> list[int]``,
        ``decode(ids) -> str``, ``apply_chat_template(messages, ...)``, ``len()``."""
        ...

    @property
    def config(self) -> EngineConfig:
        """The server's configuration (``config.server`` holds this plugin's selection)."""
        ...

    @property
    def model_name(self) -> str:
        """The model name clients send (``served_model_name``)."""
        ...

    def add_route(self, method: str, path: str, handler: Callable[[Any], Awaitable[Any]]) -> None:
        """Serve ``method path`` (aiohttp's ``add_route``: the handler takes an ``aiohttp.web.Request`` and
        returns a response). A method and path a built-in route answers is an error (a ``PluginError``). The server's API
        keys, metrics and error shape apply to the route."""
        ...

    def error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> Exception:
        """An exception to raise from a handler: the client gets ``status`` and the OpenAI error body
        ``{"error": {"message", "type", "param", "code"}}``."""
        ...


@dataclass(frozen=True)
class PromptRequest:
    """A generation request before tokenization. ``endpoint`` is ``"chat"`` (``messages`` set: the chat
    template's dicts, ``{"role", "content", ...}``) or ``"completions"`` (``prompts`` set: texts or token
    id lists). ``params``: the request's ``pluginfer.SamplingParams``; ``model``: the name it asked for."""

    endpoint: str
    request_id: str
    params: Any
    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompts: list[str | list[int]] | None = None


class RequestProcessor(Protocol):
    """A step the server runs for every chat and completions request, in the order ``server.request_processors``
    names them, on the server's event loop (keep it quick: no blocking I/O). Raise ``RequestProcessorError``
    to refuse a request with a status; any other exception is a 500 naming the processor, and the server
    goes on."""

    def preprocess(self, request: PromptRequest) -> PromptRequest:
        """The request to run: ``request`` itself, or ``dataclasses.replace(request, messages=..., prompts=...,
        params=...)`` (keep ``endpoint``; the number of prompts is the client's)."""
        ...

    def postprocess(self, request: PromptRequest, text: str, final: bool) -> str:
        """One choice's output text so far (``final``: the choice finished) as the client gets it. Called
        with the whole text at every step: streamed deltas are taken from what it returns, so what it
        returns for a growing text must grow too (return ``text`` unchanged to leave it)."""
        ...


class RequestProcessorError(Exception):
    """Refuses a request from a request processor: the client gets ``status`` (400 by default) and
    ``message`` in the API's error shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
