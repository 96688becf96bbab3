"""CoreProcessClient: the server's side of the engine core process (``pluginfer.engine.engine_core``).

An ``EngineClient`` with the engine in another process: requests go as ``AddRequest``/``AbortRequest``,
grammars compile there through ``Call``; ``ModelInfo`` comes back once, then one ``Outputs`` per step, read on
the event loop (``loop.add_reader``: no thread hop per token). A consumer that falls behind gets one output
with everything new. When the core dies its socket closes: every open request fails with ``EngineDeadError``,
``is_alive`` turns False (``/health`` answers 503) and one log line says how it died.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pluginfer.core.config import EngineConfig
from pluginfer.engine.client import EngineDeadError, EngineStats, ModelInfo
from pluginfer.engine.messages import (
    AbortRequest,
    AddRequest,
    Call,
    CallResult,
    CoreMessage,
    Failure,
    FrameReader,
    MalformedFrame,
    Outputs,
    Rejected,
    ServerMessage,
    Stop,
    encode,
)
from pluginfer.engine.outputs import RequestOutput
from pluginfer.server.client_request import ClientRequest
from pluginfer.server.core_process import CoreProcess
from pluginfer.server.core_startup import exit_code, how_it_ended, send_tokenizer, wait_ready

if TYPE_CHECKING:
    from pluginfer.engine.lora_request import LoRARequest
    from pluginfer.engine.pooling import PoolingParams
    from pluginfer.engine.sequence import SamplingParams
    from pluginfer.engine.structured import StructuredOutputsParams

logger = logging.getLogger(__name__)
# one read of the core's frames: a shorter read emptied the socket
_RECV_BYTES = 1 << 20
# (read into one buffer kept for the client's life: ``recv(1 MiB)`` allocates and maps a fresh 1 MiB each time)


class CoreProcessClient:
    """Start the engine core process; serve coroutines' requests through it (an ``EngineClient``)."""

    def __init__(self, config: EngineConfig, log_level: str | None = None,
                 process: CoreProcess | None = None) -> None:
        """Spawn the core process for ``config`` (or configure ``process``, one spawned ahead with the
        environment ``config.server.core_spin_count`` asks for: ``core_process.take_prespawned``)."""
        self.config = config
        self.startup_times: dict[str, float] = {}
        self._tokenizer: Any = None
        self._model_info: ModelInfo | None = None
        self._stats = EngineStats()
        self._requests: dict[str, ClientRequest] = {}
        self._not_started: set[str] = set()
        self._ids = itertools.count()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._reader = FrameReader(on_malformed=self._malformed)
        self._inbox = memoryview(bytearray(_RECV_BYTES))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._closed = False
        core = process or CoreProcess(config.server.core_spin_count)
        self._sock, self.process, self._spawned = core.sock, core.process, core.spawned
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        core.configure(config.model_dump_json(), str(level))

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> CoreProcessClient:
        """Wait until the core has loaded the model; take its tokenizer.

        A tokenizer built without transformers (a GGUF file's, or a checkpoint's ``tokenizer.json``:
        ``text.tokenizer.native_tokenizer``) is built here while the core imports torch, and sent to the core,
        which takes it beside its weights' load instead of building its own; any other comes from the core,
        pickled, once it is ready.
        Raises what the core raised when it could not start (ValueError for pluginfer's own errors)."""
        from pluginfer.text.tokenizer import load_tokenizer, native_tokenizer

        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            try:
                tokenizer = native_tokenizer(self.config.tokenizer or self.config.model)
            except Exception as exc:  # noqa: BLE001 - the core reports what is wrong with the file
                logger.info("no tokenizer built in the server (%s: %s)", type(exc).__name__, exc)
                tokenizer = None
            send_tokenizer(self._sock, tokenizer, deadline)
            ready = wait_ready(self._sock, self._reader, self.process,
                               None if deadline is None else max(0.0, deadline - time.monotonic()))
            if ready.tokenizer is not None:
                # not one built here (the core sends none of those: same file, code)
                tokenizer = pickle.loads(ready.tokenizer)
            elif tokenizer is None:
                tokenizer = load_tokenizer(self.config.tokenizer or ready.model_info.model_path)
        except BaseException:
            self._kill()
            raise
        self._tokenizer, self._model_info, self._stats = tokenizer, ready.model_info, ready.stats
        self.startup_times = dict(ready.startup_times)
        self.startup_times["total"] = time.perf_counter() - self._spawned  # from the spawn: its phases overlap ours
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (requests still running are aborted there, and end here with EngineDeadError);
        wait for it to exit, kill it past ``timeout``. Safe from any thread, idempotent."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(Stop())
        except OSError:
            pass
        code = self._exit_code(timeout)
        if code is None:
            logger.warning("the engine process (pid %d) did not stop within %.0f s; killing it",
                           self.process.pid, timeout)
            self._kill()
        self._on_loop(self._fail_all, EngineDeadError("the engine was shut down"))
        self._on_loop(self._close)

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _exit_code(self, timeout: float) -> int | None:
        return exit_code(self.process, timeout)

    def attach(self) -> None:
        """Read the core's frames on the running event loop from now on (the server calls it as it starts;
        else the first request does): a core that dies while idle is then noticed at once."""
        self._attach(asyncio.get_running_loop())

    @property
    def is_alive(self) -> bool:
        return (self._error is None and not self._stopping and self._model_info is not None
                and self.process.poll() is None)

    @property
    def error(self) -> BaseException | None:
        """Why the engine cannot serve (None while it runs or after a clean shutdown)."""
        if self._error is None and not self._stopping and self.process.poll() is not None:
            self._error = RuntimeError(f"the engine process (pid {self.process.pid}) exited "
                                       f"{how_it_ended(self.process.returncode)}")
        return self._error

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self._not_started)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_info(self) -> ModelInfo:
        if self._model_info is None:
            raise RuntimeError("the engine process has not started yet (call start())")
        return self._model_info

    @property
    def stats(self) -> EngineStats:
        """As of the core's last frame."""
        return self._stats

    def compile_grammar(self, grammar: StructuredOutputsParams) -> None:
        """Compiled (and cached) in the core, off its step loop; blocks until it answers: call it off the event
        loop. Raises StructuredOutputError with the core's reason."""
        from pluginfer.engine.structured import StructuredOutputError

        result: CallResult = self.call("compile_grammar", grammar).result()
        if result.error_type is not None:
            if result.error_type == "StructuredOutputError":
                raise StructuredOutputError(result.message)
            raise RuntimeError(f"{result.error_type}: {result.message}")

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read a LoRA adapter and fit it to the model, in the core; a ValueError with the core's reason.
        Blocks: call it off the event loop."""
        result: CallResult = self.call("check_lora", lora_request).result()
        if result.error_type is not None:
            raise (ValueError if result.error_type == "ValueError" else RuntimeError)(result.message)

    # -- requests -----------------------------------------------------------------------------

    def encode(self, prompt: str | list[int], params: PoolingParams, request_id: str | None = None,
               lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """An embedding or score request: its output once finished (``RequestOutput.embedding``)."""
        return self.generate(prompt, params, request_id, lora_request)

    async def generate(self, prompt: str | list[int], params: SamplingParams | PoolingParams,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's output as it grows; the last one is finished."""
        if not self.is_alive:
            error = self.error
            why = f"it died: {error}" if error else "it was shut down"
            raise EngineDeadError(f"the engine is not running ({why})")
        loop = asyncio.get_running_loop()
        self._attach(loop)
        request_id = request_id or f"client-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = ClientRequest(loop, prompt, params.n)
        self._requests[request_id] = request
        self._not_started.add(request_id)
        finished = False
        try:
            self._send(AddRequest(request_id, prompt, params, lora_request))
            while True:
                if not request.fresh and request.failure is None:
                    request.waiter = loop.create_future()
                    await request.waiter
                    request.waiter = None
                if request.failure is not None:
                    finished = True  # the core never ran it, or has dropped it: nothing to abort
                    raise request.failure
                self._not_started.discard(request_id)
                output = request.snapshot(request_id)
                finished = output.finished
                yield output
                if finished:
                    return
        except OSError as exc:  # the channel broke while sending
            finished = True
            raise EngineDeadError(f"the engine is not running: {exc}") from None
        finally:
            self._requests.pop(request_id, None)
            self._not_started.discard(request_id)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        try:
            self._send(AbortRequest(request_id))
        except OSError:
            pass  # the core is gone: so is the request

    def call(self, method: str, *arguments: Any) -> Future:
        """Ask the core something answered off its step loop (``compile_grammar``); a Future of its
        ``CallResult``."""
        future: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        if not self.is_alive:
            future.set_exception(EngineDeadError("the engine is not running"))
            return future
        try:
            self._send(Call(call_id, method, arguments))
        except OSError as exc:
            self._calls.pop(call_id, None)
            future.set_exception(EngineDeadError(f"the engine is not running: {exc}"))
        return future

    # -- the channel --------------------------------------------------------------------------

    def _send(self, message: ServerMessage) -> None:
        data = encode(message)
        with self._send_lock:
            # the core's reader thread always drains its end: this does not block long
            self._sock.sendall(data)

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the core's frames on the first event loop that serves a request (the socket stays
        blocking for sends; reads ask for what is there with MSG_DONTWAIT), or on this one if that loop
        was closed since (one ``asyncio.run`` after another)."""
        if self._loop is not None and self._loop.is_closed():
            self._loop = None
        if self._loop is None and not self._closed:
            self._loop = loop
            loop.add_reader(self._sock.fileno(), self._on_readable)

    def _on_loop(self, callback: Any, *arguments: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            callback(*arguments)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            callback(*arguments)
        else:
            try:
                loop.call_soon_threadsafe(callback, *arguments)
            except RuntimeError:  # closed meanwhile
                callback(*arguments)

    def _on_readable(self) -> None:
        while True:
            try:
                size = self._sock.recv_into(self._inbox, _RECV_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._lost(f"its channel failed: {exc}")
                return
            if not size:
                self._lost(None)
                return
            self._receive(self._inbox[:size])
            if size < _RECV_BYTES:
                # the socket is drained: no second recv to hear EAGAIN (once a token)
                return

    def _receive(self, data: bytes | memoryview) -> None:
        for message in self._reader.feed(data):
            self._dispatch(message)

    def _dispatch(self, message: CoreMessage) -> None:
        if isinstance(message, Outputs):
            for delta in message.deltas:
                request = self._requests.get(delta.request_id)
                if request is None:
                    continue  # its consumer left; the abort is on its way
                if request.loop is self._loop:
                    request.apply(delta)
                else:
                    # a request from another event loop (several servers over one client)
                    request.loop.call_soon_threadsafe(request.apply, delta)
            self._stats = message.stats
        elif isinstance(message, Rejected):
            request = self._requests.get(message.request_id)
            if request is not None:
                kind, text = message.error_type, message.message
                failure = ValueError(text) if kind in ("ValueError", "StructuredOutputError") else \
                    RuntimeError(f"{kind}: {text}")
                self._deliver_failure(request, failure)
        elif isinstance(message, CallResult):
            future = self._calls.pop(message.call_id, None)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, Failure):
            self._error = RuntimeError(message.reason)
            logger.error("pluginfer: the engine loop died in its process (pid %d): %s", self.process.pid,
                         message.reason)
            self._fail_all(EngineDeadError(f"the engine loop died: {message.reason}"))
        else:
            logger.error("pluginfer: the engine process sent %s out of turn; ignored", type(message).__name__)

    def _malformed(self, exc: MalformedFrame) -> None:
        """A frame that is no message: dropped (the requests it was for wait on the next step's frame)."""
        logger.error("pluginfer: the engine process (pid %d) sent a malformed frame, dropped: %s",
                     self.process.pid, exc)

    def _deliver_failure(self, request: ClientRequest, failure: BaseException) -> None:
        if request.loop is self._loop or request.loop.is_closed():
            request.fail(failure)
        else:
            request.loop.call_soon_threadsafe(request.fail, failure)

    def _lost(self, why: str | None) -> None:
        """The core's end closed: it exited, or is about to."""
        self._close()
        if self._stopping:
            return
        code = self._exit_code(2.0)
        if why is None:
            why = f"exited {how_it_ended(code)}" if code is not None else "closed its channel"
        if self._error is None:
            self._error = RuntimeError(f"the engine process (pid {self.process.pid}) {why}")
            logger.error("pluginfer: the engine process (pid %d) %s; no request can be served", self.process.pid,
                         why)
        self._fail_all(EngineDeadError(f"the engine is not running: {self._error}"))

    def _fail_all(self, failure: BaseException) -> None:
        for request in list(self._requests.values()):
            self._deliver_failure(request, failure)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(failure)
        self._calls.clear()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._sock.fileno())
            except (ValueError, RuntimeError):
                pass
        self._sock.close()

