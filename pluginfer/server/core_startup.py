"""The engine core process's start-up, seen from the server: the tokenizer handed over, then ``Ready`` (or
``StartFailed``, raised here) read from the core's socket; and how a core process ended, in words."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time
from typing import Any

from pluginfer.engine.messages import FrameReader, Ready, ServerTokenizer, StartFailed, encode

logger = logging.getLogger(__name__)


def send_tokenizer(sock: socket.socket, tokenizer: Any, deadline: float | None) -> None:
    """The core's first message: the tokenizer built in the server, or None (the core loads its own)."""
    try:
        frame = encode(ServerTokenizer(tokenizer))
    except Exception as exc:  # noqa: BLE001 - a tokenizer that does not pickle: the core loads its own
        logger.info("the tokenizer does not pickle (%s); the engine process loads its own", exc)
        frame = encode(ServerTokenizer(None))
    sock.settimeout(None if deadline is None else max(0.001, deadline - time.monotonic()))
    try:
        sock.sendall(frame)  # the core reads it while its weights load
    except TimeoutError:
        raise RuntimeError("the engine process did not take its tokenizer in time") from None
    except OSError:
        pass  # the core is gone: wait_ready reads why
    finally:
        sock.settimeout(None)


def wait_ready(sock: socket.socket, reader: FrameReader, process: subprocess.Popen, timeout: float | None) -> Ready:
    """The core's ``Ready``; what it raised when it could not start (ValueError for pluginfer's own errors)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        sock.settimeout(remaining)
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            raise RuntimeError(f"the engine process did not start within {timeout} s") from None
        finally:
            sock.settimeout(None)
        if not data:
            code = exit_code(process, 10.0)
            raise RuntimeError(f"the engine process (pid {process.pid}) exited {how_it_ended(code)} while "
                               "loading the model (its log is above)")
        for message in reader.feed(data):
            if isinstance(message, Ready):
                return message
            if isinstance(message, StartFailed):
                exit_code(process, 10.0)
                if message.error_type == "ValueError":
                    raise ValueError(message.message)
                raise RuntimeError(f"{message.error_type}: {message.message}")


def exit_code(process: subprocess.Popen, timeout: float) -> int | None:
    """The process's exit code once it ends within ``timeout`` seconds, else None."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def how_it_ended(code: int | None) -> str:
    if code is None:
        return "(still running)"
    if code < 0:
        try:
            return f"on signal {signal.Signals(-code).name}"
        except ValueError:
            return f"on signal {-code}"
    return f"with code {code}"
