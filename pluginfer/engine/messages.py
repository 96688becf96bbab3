"""The messages between the server and the engine core process, and their framing.

Each message is a frozen dataclass; a frame is a 4-byte big-endian length, then the message pickled. A frame
that does not decode to one of these is a ``MalformedFrame``: the reader drops it and goes on. Server to core:
``ServerTokenizer``, ``AddRequest``, ``AbortRequest``, ``Call``, ``Stop``; core to server: ``Ready`` (or
``StartFailed``), one ``Outputs`` per step, ``Rejected``, ``CallResult``, ``Failure``. Standard library only:
both processes import it before anything heavy.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

from pluginfer.engine.client import EngineStats, ModelInfo

_LENGTH = struct.Struct(">I")


# -- server to core --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerTokenizer:
    """The tokenizer the server built (the core takes it instead of building one), or None."""

    tokenizer: Any


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: Any  # SamplingParams or PoolingParams
    lora_request: Any = None  # the LoRARequest it runs with, or None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Call:
    """Ask the core for ``method(*arguments)`` (``compile_grammar``), answered by a ``CallResult``."""

    call_id: int
    method: str
    arguments: tuple = ()


@dataclass(frozen=True)
class Stop:
    """Abort what runs and exit."""


# -- core to server --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    pid: int
    model_info: ModelInfo
    tokenizer: bytes | None  # pickled; None: the server builds its own (or sent it)
    startup_times: dict[str, float]
    stats: EngineStats  # after the warm-up request


@dataclass(frozen=True)
class StartFailed:
    # "ValueError" for pluginfer's own errors (a bad config, a missing file)
    error_type: str
    message: str


@dataclass(frozen=True)
class PromptInfo:
    """A request's prompt as the engine read it, sent with its first delta."""

    prompt: str | None
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice gained since the last ``Outputs``."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None  # None unless the request asked for logprobs
    finish_reason: str | None


@dataclass(frozen=True)
class RequestDelta:
    """What one request gained in a step."""

    request_id: str
    prompt: PromptInfo | None  # the first time only
    choices: list[ChoiceDelta]
    finished: bool
    error: str | None
    num_cached_tokens: int
    embedding: list[float] | None


@dataclass(frozen=True)
class Outputs:
    """One step's deltas (one frame per step whatever the number of requests) and the engine's gauges."""

    deltas: list[RequestDelta]
    stats: EngineStats


@dataclass(frozen=True)
class Rejected:
    request_id: str
    error_type: str
    message: str


@dataclass(frozen=True)
class CallResult:
    call_id: int
    value: Any = None
    error_type: str | None = None  # None: the call returned ``value``
    message: str = ""


@dataclass(frozen=True)
class Failure:
    """The step loop died; why."""

    reason: str


ServerMessage = ServerTokenizer | AddRequest | AbortRequest | Call | Stop
CoreMessage = Ready | StartFailed | Outputs | Rejected | CallResult | Failure
MESSAGE_TYPES = (ServerTokenizer, AddRequest, AbortRequest, Call, Stop,
                 Ready, StartFailed, Outputs, Rejected, CallResult, Failure)


class MalformedFrame(ValueError):
    """A frame that is not one of the messages above (it is dropped; the next frame reads normally)."""


# -- framing -----------------------------------------------------------------------------------------


def encode(message: ServerMessage | CoreMessage) -> bytes:
    """One frame; a TypeError for anything that is not a message."""
    if not isinstance(message, MESSAGE_TYPES):
        raise TypeError(f"not an engine message: {type(message).__name__}")
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def decode(payload: bytes | memoryview) -> ServerMessage | CoreMessage:
    """A frame's payload (without its length) back to its message; MalformedFrame saying what it held."""
    try:
        message = pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes were, the error names the frame
        raise MalformedFrame(f"a frame of {len(payload)} bytes does not decode ({type(exc).__name__}: {exc}); "
                             f"it begins {bytes(payload[:16])!r}") from None
    if not isinstance(message, MESSAGE_TYPES):
        raise MalformedFrame(f"a frame of {len(payload)} bytes holds a {type(message).__name__}, not an engine "
                             f"message: {_shorten(repr(message))}")
    return message


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class FrameReader:
    """Bytes in, whole messages out (a frame may arrive in pieces); a malformed frame is handed to
    ``on_malformed`` and skipped."""

    def __init__(self, on_malformed: Any = None) -> None:
        self._buffer = bytearray()
        self._on_malformed = on_malformed

    def feed(self, data: bytes | memoryview) -> list[ServerMessage | CoreMessage]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            view = memoryview(self._buffer)
            payload = view[_LENGTH.size:end]
            try:
                messages.append(decode(payload))
            except MalformedFrame as exc:
                if self._on_malformed is None:
                    raise
                self._on_malformed(exc)
            finally:
                payload.release()  # the buffer cannot shrink while a view of it is alive
                view.release()
                del self._buffer[:end]
        return messages


def receive_frame(sock: socket.socket) -> ServerMessage | CoreMessage:
    """One message off a blocking socket, exactly: what follows it stays there for the next reader."""
    header = _receive_exactly(sock, _LENGTH.size)
    (length,) = _LENGTH.unpack(header)
    return decode(_receive_exactly(sock, length))


def _receive_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if not count:
            raise OSError("the server closed its end")
        got += count
    return buffer
