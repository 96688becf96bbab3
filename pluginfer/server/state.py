"""What every handler needs: the engine client, the configuration, the metrics; and reading a request body."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from pluginfer.core.config import EngineConfig, SamplingDefaults
from pluginfer.core.parsers import ReasoningParser, ToolCallParser
from pluginfer.core.registry import get_registry
from pluginfer.engine.client import EngineClient, ModelInfo
from pluginfer.engine.generation_config import sampling_defaults
from pluginfer.engine.pooling import PoolerConfig
from pluginfer.server.errors import APIError, bad_request, from_validation_error
from pluginfer.server.metrics import ServerMetrics
from pluginfer.server.request_processors import RequestProcessors
from pluginfer.text.fim import FimTokens, fim_tokens

if TYPE_CHECKING:
    from pluginfer.engine.lora_request import LoRARequest
    from pluginfer.server.lora import ServedAdapters

Body = TypeVar("Body", bound=BaseModel)


@dataclass
class ServerState:
    """One served model, and the engine that serves it (only through the ``EngineClient`` protocol)."""

    engine: EngineClient
    config: EngineConfig
    model_name: str
    metrics: ServerMetrics
    reasoning_parser: Callable[[], ReasoningParser] | None = None  # the plugin's factory: one parser per choice
    tool_parser: Callable[[], ToolCallParser] | None = None  # the plugin's factory: one parser per request
    processors: RequestProcessors = field(default_factory=RequestProcessors)  # build_app loads the selected ones
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)  # every field set: what requests default to
    # other names a request may give the model (a GGUF file's name and path)
    aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    # SIGTERM with server.shutdown_timeout: requests in flight finish, new ones get a 503
    draining: bool = False
    # the checkpoint's pooling, read at the first /v1/embeddings request
    pooler: PoolerConfig | None = None
    adapters: ServedAdapters | None = None  # the LoRA adapters a request may name as its model
    _vocab_size: int | None = field(default=None, repr=False)
    _fim: tuple[FimTokens | None] | None = field(default=None, repr=False)

    @classmethod
    def create(cls, engine: EngineClient, config: EngineConfig) -> ServerState:
        server, registry = config.server, get_registry()
        reasoning = registry.load("reasoning_parser", server.reasoning_parser) if server.reasoning_parser else None
        tools = registry.load("tool_parser", server.tool_call_parser) if server.tool_call_parser else None
        from pluginfer.server.lora import ServedAdapters

        name, *aliases = served_names(config)
        return cls(engine, config, name, ServerMetrics(engine), reasoning, tools,
                   sampling=sampling_defaults(config.sampling, engine.model_info.model_path),
                   aliases=tuple(aliases), adapters=ServedAdapters(config))

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def root(self) -> str:
        """What ``/v1/models`` says the model is: a hub id as given; a local checkpoint by its served name."""
        return self.model_name if Path(self.config.model).expanduser().exists() else self.config.model

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``, asked once: a tokenizers.Tokenizer counts its whole vocabulary each time (3 ms
        for 49k tokens, once a request before)."""
        if self._vocab_size is None:
            self._vocab_size = len(self.tokenizer)
        return self._vocab_size

    @property
    def fim(self) -> FimTokens | None:
        """The tokenizer's fill-in-the-middle ids (None: it has none), read once: it walks the vocabulary."""
        if self._fim is None:
            self._fim = (fim_tokens(self.tokenizer),)
        return self._fim[0]

    def check_model(self, model: str | None) -> None:
        """An absent (or empty) model means the served one; a LoRA adapter's name is that adapter; any other name
        is a 404, as in OpenAI."""
        if model and model != self.model_name and model not in self.aliases and self.lora_for(model) is None:
            adapters = f" and the LoRA adapters {sorted(self.adapters.by_name)}" \
                if self.adapters is not None and self.adapters.by_name else ""
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}"
                           f"{adapters}", "model", "model_not_found")

    def answer_model(self, model: str | None) -> str:
        """The ``model`` an answer carries: the LoRA adapter the request named (as vLLM), else the served name."""
        return model if self.lora_for(model) is not None else self.model_name  # type: ignore[return-value]

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, or None (the base model)."""
        return None if self.adapters is None or not model else self.adapters.by_name.get(model)

    def admit(self) -> None:
        """Refuse work the engine cannot take: 503 once its loop died, 429 while too many wait."""
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", code="shutting_down")
        limit = self.config.server.max_waiting
        if self.engine.num_waiting >= limit:
            raise APIError(429, f"too many requests waiting ({self.engine.num_waiting}, at most {limit}); "
                           "retry later", code="rate_limit_exceeded")


def served_names(config: EngineConfig) -> tuple[str, ...]:
    """The model's name for clients (``server.served_model_name``, else a GGUF file's stem, else ``model``), then
    the other names a request may use: a GGUF file's name and path (its directory stays off the API)."""
    if config.server.served_model_name:
        return (config.server.served_model_name,)
    path = Path(config.model)
    return (path.stem, path.name, config.model) if path.suffix == ".gguf" else (config.model,)


STATE = web.AppKey("pluginfer_state", ServerState)


async def read_body(request: web.Request, model: type[Body]) -> Body:
    """The JSON body validated as ``model``: 400 for a wrong content type, bad JSON or bad fields."""
    if request.content_type != "application/json":
        raise bad_request(f"the body must be JSON (Content-Type: application/json), got {request.content_type!r}")
    limit = request.app[STATE].config.server.max_request_bytes
    if request.content_length is not None and request.content_length > limit:  # refused before it is read
        raise APIError(413, f"request body too large: {request.content_length} bytes, at most {limit} "
                       "(server.max_request_bytes)", code="request_too_large")
    # aiohttp answers 413 beyond the app's client_max_size (a chunked body)
    raw = await request.read()
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")
