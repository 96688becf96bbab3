"""EngineView: what the server's handlers and metrics read of an engine that runs in the engine core process
(``EngineClient.engine``): the tokenizer, ``max_model_len``, the gauges the core's step frames update, and
grammar compilation in the core.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pluginfer.core.config import EngineConfig

if TYPE_CHECKING:
    from pluginfer.server.engine_client import EngineClient


class _Scheduler:
    """The gauges' view of the core's scheduler, updated with every step's frame."""

    num_running = 0
    num_waiting = 0


class _BlockManager:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.usage = 0.0


class _Grammars:
    """``engine.grammars.compile`` for the handlers: compiled (and cached) in the core, off its step loop."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def compile(self, grammar: Any) -> None:
        """Blocks until the core compiled it; raises StructuredOutputError with the core's reason.
        Call it off the event loop (the handlers use ``asyncio.to_thread``)."""
        from pluginfer.engine.structured import StructuredOutputError

        error = self._client.call("compile", grammar).result()
        if error is not None:
            kind, message = error
            raise StructuredOutputError(message) if kind == "StructuredOutputError" else RuntimeError(message)


class EngineView:
    """What the handlers and the metrics read of the engine, in the server's process."""

    def __init__(self, client: EngineClient, config: EngineConfig, info: dict[str, Any], tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len: int = info["max_model_len"]
        self.eos_token_ids = set(info["eos_token_ids"])
        self.model_path = Path(info["model_path"])
        self.scheduler = _Scheduler()
        self.block_manager = _BlockManager(info["num_blocks"])
        self.grammars = _Grammars(client)

    def has_unfinished_requests(self) -> bool:
        """As the core's last frame saw it (waiting or running sequences)."""
        return bool(self.scheduler.num_running or self.scheduler.num_waiting)
