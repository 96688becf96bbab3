"""AsyncEngine: LLMEngine's step loop in its own thread, one asyncio queue per request; an ``EngineClient``.

The engine is touched only by the loop thread. Coroutines hand it commands (``AddRequest``, ``AbortRequest``)
through a thread-safe queue and receive RequestOutputs through ``loop.call_soon_threadsafe``, once per
step for all the requests of one event loop; the loop thread publishes the engine's ``EngineStats`` after
every step.
Leaving ``generate`` early (a client that disconnects cancels its handler) aborts the request,
whose KV blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pluginfer.engine.client import EngineDeadError, EngineStats, ModelInfo
from pluginfer.engine.engine import LLMEngine
from pluginfer.engine.lora_request import LoRARequest
from pluginfer.engine.messages import AbortRequest, AddRequest
from pluginfer.engine.outputs import RequestOutput
from pluginfer.engine.pooling import PoolingParams
from pluginfer.engine.sequence import SamplingParams
from pluginfer.engine.structured import StructuredOutputsParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError"]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # that event loop is closed: nobody is listening any more
            pass


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream_queue, output in batch:
        stream_queue.put_nowait(output)


class AsyncEngine:
    """Serve many concurrent requests from coroutines; continuous batching happens in the thread."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._ids = itertools.count()
        self._not_started: set[str] = set()  # accepted, no output yet (read by coroutines only)
        self._error: BaseException | None = None
        self._model_info = engine.model_info()
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="pluginfer-engine", daemon=True)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def attach(self) -> None:
        """Nothing to do: the loop thread delivers to whichever event loop a request came from."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still running are aborted; the other ranks are stopped."""
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.executor.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stop.is_set()

    @property
    def error(self) -> BaseException | None:
        """Why the loop died (None while it runs or after a clean shutdown)."""
        return self._error

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished (waiting or running)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have produced no output yet (queued, or their prompt is being read)."""
        return len(self._not_started)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def stats(self) -> EngineStats:
        """As of the last step (published by the loop thread)."""
        return self._stats

    def compile_grammar(self, grammar: StructuredOutputsParams) -> None:
        """Compile (or find cached) ``grammar``; StructuredOutputError says why not. Blocks: call it off the
        event loop."""
        self.engine.grammars.compile(grammar)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read a LoRA adapter and fit it to the model; a ValueError naming what is wrong. Blocks: call it off
        the event loop."""
        self.engine.check_lora(lora_request)

    # -- requests -----------------------------------------------------------------------------

    def encode(self, prompt: str | list[int], params: PoolingParams, request_id: str | None = None,
               lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """An embedding or score request: its output once finished (``RequestOutput.embedding``)."""
        return self.generate(prompt, params, request_id, lora_request)

    async def generate(self, prompt: str | list[int], params: SamplingParams | PoolingParams,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that changed it; the last one is finished."""
        if not self.is_alive:
            why = f"it died: {type(self.error).__name__}: {self.error}" if self.error else "it was shut down"
            raise EngineDeadError(f"the engine loop is not running ({why})")
        request_id = request_id or f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._not_started.add(request_id)
        self._commands.put(AddRequest(request_id, prompt, params, lora_request))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                self._not_started.discard(request_id)
                if isinstance(item, BaseException):
                    finished = True  # the loop never ran it, or has dropped it: nothing to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._not_started.discard(request_id)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))
        self._wakeup.set()

    # -- the loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # before draining, so a command queued meanwhile is not slept through
                self._wakeup.clear()
                self._drain_commands()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._stats = self.engine.stats()
                    self._deliver(outputs)
                else:
                    if self.engine.failure:
                        # a rank was lost while idle: fail now, not at the next request
                        raise RuntimeError(self.engine.failure)
                    self._stats = self.engine.stats()  # requests aborted while idle free their blocks
                    self._wakeup.wait(self._idle_wait_s)
            self.engine.abort_all()
            reason: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # the loop dies; every waiting request learns why
            logger.exception("engine loop died")
            self._error = exc
            reason = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}")
        for stream in list(self._streams.values()):
            stream.put(reason)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs reach each event loop in one callback (one wake-up per step, not per request)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest):
                stream = self._streams.get(command.request_id)
                if stream is None:  # abandoned before it was added
                    continue
                try:
                    self.engine.add_request(command.prompt, command.params, request_id=command.request_id,
                                            lora_request=command.lora_request)
                except Exception as exc:  # bad input for this request only
                    stream.put(exc)
            else:
                self.engine.abort_request(command.request_id)
