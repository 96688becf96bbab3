"""EngineClient: all the server knows of an engine, wherever it runs; and the values it reads through it.

The HTTP server (its handlers, ``/health``, ``/metrics``, its start and drain) depends on this protocol alone.
Two classes implement it: ``pluginfer.engine.async_engine.AsyncEngine`` (the step loop in a thread of the
server's process) and ``pluginfer.server.core_client.CoreProcessClient`` (the engine core in a process of its
own, over typed messages: ``pluginfer.engine.messages``). Neither hands out the engine's objects: what the
server reads of the engine is a value, ``ModelInfo`` once and ``EngineStats`` as it changes.

Torch-free, as everything the server's process imports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pluginfer.engine.lora_request import LoRARequest
    from pluginfer.engine.outputs import RequestOutput
    from pluginfer.engine.pooling import PoolingParams
    from pluginfer.engine.sequence import SamplingParams
    from pluginfer.engine.structured import StructuredOutputsParams


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error (or the engine was shut down); no request can be served any more."""


@dataclass(frozen=True)
class ModelInfo:
    """What the served model is, fixed once the engine has loaded it."""

    model_path: str
    max_model_len: int
    vocab_size: int  # rows of the model's logits (``len(tokenizer)`` may differ)
    eos_token_ids: frozenset[int]
    num_blocks: int
    block_size: int
    # media the model takes besides text (``multi_modal_data`` keys: "image")
    modalities: tuple[str, ...] = ()

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and counters as of its last step (the server's /metrics reads them)."""

    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # sequences waiting to be scheduled
    kv_cache_usage: float = 0.0  # fraction of KV blocks some sequence holds (0 to 1)
    num_free_blocks: int = 0  # prefix-cached ones included
    num_blocks: int = 0
    num_preemptions: int = 0  # since the engine started
    # prompt tokens looked up in the prefix cache since the start
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0  # of those, tokens found there
    # speculative decoding: decodes given draft tokens since the start
    spec_drafts: int = 0
    spec_draft_tokens: int = 0  # the draft tokens they were given
    spec_accepted_tokens: int = 0  # of those, the ones the model agreed with


# What the server calls; tests/engine/test_client.py checks both implementations have each one.
ENGINE_CLIENT_MEMBERS = ("generate", "encode", "abort", "tokenizer", "model_info", "stats", "compile_grammar",
                         "check_lora", "is_alive", "error", "num_requests", "num_waiting", "attach", "shutdown")


@runtime_checkable
class EngineClient(Protocol):
    """An engine serving coroutines' requests (see the module's docstring for who implements it)."""

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str | None = None, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's output after every step that changed it; the last one is finished (``lora_request``:
        the LoRA adapter it runs with). Raises EngineDeadError when the engine is not running, ValueError for a
        request it refuses."""
        ...

    def encode(self, prompt: str | list[int], params: PoolingParams, request_id: str | None = None,
               lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """An embedding or score request: its output once finished (``RequestOutput.embedding``); the adapter and
        errors as ``generate``'s."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop the request and free what it holds (leaving ``generate`` early does it too)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer, with its chat template (``pluginfer.text``)."""
        ...

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def stats(self) -> EngineStats:
        """The latest gauges (a value: read it again for newer ones)."""
        ...

    def compile_grammar(self, grammar: StructuredOutputsParams) -> None:
        """Compile (or find cached) a request's grammar; raises StructuredOutputError saying why it does not
        compile. Blocks: call it off the event loop."""
        ...

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read a LoRA adapter and fit it to the model (``lora.enable_lora``); a ValueError naming what is wrong
        with it. Blocks: call it off the event loop."""
        ...

    @property
    def is_alive(self) -> bool:
        """The engine serves requests (False once it died or was shut down)."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine died (None while it runs or after a clean shutdown)."""
        ...

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have produced no output yet."""
        ...

    def attach(self) -> None:
        """Called on the server's event loop as it starts: a client that reads the engine on that loop starts
        there, so an engine that dies while idle is noticed at once."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests still running end with EngineDeadError. Idempotent."""
        ...
