"""The engine core in a process of its own: LLMEngine's step loop, fed and drained over one socket.

As vLLM V1 splits its API server from its engine core, ``pluginfer serve``'s HTTP event loop and the step loop
never share an interpreter lock; ``server.core_client.CoreProcessClient`` is the other end. Run as
``python -m pluginfer.engine.engine_core FD [SPAWNED]``, then the log level and the config's JSON on stdin.
Frames are ``engine.messages``' dataclasses: ``ServerTokenizer``, requests, aborts and calls in; ``Ready``, then
one ``Outputs`` per step (whatever the number of requests), ``Rejected``, ``CallResult``, ``Failure`` out.
A reader thread takes frames off the socket (and compiles grammars) off the step loop; the core exits when
told to, when the server's end closes, or when its loop fails.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from typing import Any

from pluginfer.engine.messages import (
    AbortRequest,
    AddRequest,
    Call,
    CallResult,
    ChoiceDelta,
    CoreMessage,
    Failure,
    FrameReader,
    MalformedFrame,
    Outputs,
    PromptInfo,
    Ready,
    Rejected,
    RequestDelta,
    ServerTokenizer,
    StartFailed,
    Stop,
    encode,
    receive_frame,
)

logger = logging.getLogger("pluginfer.engine.engine_core")  # also when run as __main__

# how often an idle core looks at engine.failure (a lost rank) while it waits
_IDLE_CHECK_S = 0.25


def error_name(exc: BaseException) -> str:
    return type(exc).__name__


def _log_timings(timings: list[tuple[float, float, float]]) -> None:
    """DEBUG: where a run of steps spent its time (step, sending its frame, between steps)."""
    steps = sorted(b - a for a, b, _ in timings)
    sends = sorted(c - b for _, b, c in timings)
    gaps = sorted(timings[i + 1][0] - timings[i][2] for i in range(len(timings) - 1))
    logger.debug("last %d steps: median step %.2f ms, frame %.3f ms, between steps %.3f ms (max %.1f)",
                 len(timings), steps[len(steps) // 2] * 1e3, sends[len(sends) // 2] * 1e3,
                 gaps[len(gaps) // 2] * 1e3, gaps[-1] * 1e3)


# -- the core -----------------------------------------------------------------------------------


class EngineCore:
    """Runs in the core process: the engine, the reader thread, the step loop."""

    def __init__(self, config: Any, sock: socket.socket) -> None:
        self.config = config
        self.sock = sock
        self._send_lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: dict[str, list[list[int]]] = {}  # request id -> per choice [tokens, chars, logprobs] sent
        self.engine: Any = None

    def send(self, message: CoreMessage) -> None:
        data = encode(message)
        with self._send_lock:
            self.sock.sendall(data)

    # -- start-up -------------------------------------------------------------------------------

    def load(self, spawned: float | None = None) -> Ready:
        """Build the engine and run one short request through it; what the server needs to know.

        ``spawned``: the server's ``time.perf_counter()`` when it started this process (the same clock across
        processes on Linux); the time from it to here is the ``start`` phase (the interpreter, the config)."""
        started = time.perf_counter()
        times = {} if spawned is None else {"start": max(0.0, started - spawned)}
        from pluginfer.engine.engine import LLMEngine
        from pluginfer.engine.pooling import PoolingParams
        from pluginfer.engine.sequence import SamplingParams
        from pluginfer.formats.gguf.tokenizer import GGUFTokenizer

        times["imports"] = time.perf_counter() - started
        started = time.perf_counter()
        self.engine = engine = LLMEngine(self.config, receive_tokenizer=self._receive_tokenizer)
        built = time.perf_counter() - started
        times.update(engine.startup_times)  # config, build, load, repack, cache, tokenizer
        times["other"] = max(0.0, built - sum(engine.startup_times.values()))  # plugins, backend, scheduler
        started = time.perf_counter()
        # Warm-up: the first step pays for first touches (weight pages, kernel tables, allocator pools).
        vocab = engine.executor.vocab_size
        # a bare decoder (an embedding checkpoint) only embeds; a cross-encoder only scores
        warmup = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True) if engine.can_generate else \
            PoolingParams(task="score" if engine.scores else "embed")
        pools = (engine.scorer if engine.scores else engine.pooler).problem is None
        if engine.can_generate or pools:
            engine.add_request([i % vocab for i in range(1, 9)], warmup, request_id="pluginfer-warmup")
        while engine.has_unfinished_requests():
            engine.step()
        times["warm-up"] = time.perf_counter() - started
        logger.info("engine core start-up: %s", ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
        tokenizer = None
        # A tokenizer built without transformers (a GGUF file's, an HFTokenizer) is the server's own.
        if not isinstance(engine.tokenizer, GGUFTokenizer):
            try:
                # the server takes the tokenizer from here: unpickling it is far cheaper than loading it again
                tokenizer = pickle.dumps(engine.tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - the server loads its own
                logger.info("the tokenizer does not pickle (%s); the server loads its own", exc)
        return Ready(pid=os.getpid(), model_info=engine.model_info(), tokenizer=tokenizer, startup_times=times,
                     stats=engine.stats())

    def _receive_tokenizer(self) -> Any:
        """The server's first message, its tokenizer (or None), read while the weights load."""
        message = receive_frame(self.sock)
        if not isinstance(message, ServerTokenizer):
            raise RuntimeError(f"the server sent {type(message).__name__} before its tokenizer")
        return message.tokenizer

    # -- the reader thread ----------------------------------------------------------------------

    def _read(self) -> None:
        reader = FrameReader(on_malformed=self._malformed)
        inbox = memoryview(bytearray(1 << 20))  # one buffer: recv(1 MiB) would map a fresh 1 MiB every time
        try:
            while True:
                size = self.sock.recv_into(inbox)
                if not size:
                    break
                for message in reader.feed(inbox[:size]):
                    if isinstance(message, Call):
                        self._call(message)
                    else:
                        self._commands.put(message)
        except OSError:
            pass
        self._commands.put(None)  # the server's end closed

    @staticmethod
    def _malformed(exc: MalformedFrame) -> None:
        logger.error("the server sent a malformed frame, dropped: %s", exc)

    def _call(self, call: Call) -> None:
        """A utility the server asked for, answered here, off the step loop."""
        methods = {"compile_grammar": self._compile_grammar, "check_lora": self.engine.check_lora}
        try:
            method = methods.get(call.method)
            if method is None:
                raise ValueError(f"no engine call {call.method!r}; there are {', '.join(methods)}")
            result = CallResult(call.call_id, method(*call.arguments))
            frame = encode(result)
        except Exception as exc:  # noqa: BLE001 - the server raises it (a grammar's error is a 400 there)
            frame = encode(CallResult(call.call_id, error_type=error_name(exc), message=str(exc)))
        try:
            with self._send_lock:
                self.sock.sendall(frame)
        except OSError:
            pass

    def _compile_grammar(self, grammar: Any) -> None:
        """Compiled into the engine's cache; the compiled matcher stays here (it does not pickle)."""
        self.engine.grammars.compile(grammar)

    # -- the step loop --------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until told to stop (0), the server goes away (0) or the loop fails (1)."""
        threading.Thread(target=self._read, name="pluginfer-core-reader", daemon=True).start()
        engine = self.engine
        idle_reported = True
        timings: list[tuple[float, float, float]] | None = [] if logger.isEnabledFor(logging.DEBUG) else None
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not busy and engine.failure:
                    # a rank was lost while idle: fail now, not at the next request
                    raise RuntimeError(engine.failure)
                if self._drain(block=not busy):
                    return 0
                if engine.has_unfinished_requests():
                    started = time.perf_counter()
                    outputs = engine.step()
                    stepped = time.perf_counter()
                    self._send_outputs(outputs)
                    if timings is not None:
                        timings.append((started, stepped, time.perf_counter()))
                        if len(timings) == 256:
                            _log_timings(timings)
                            timings.clear()
                    idle_reported = False
                elif not idle_reported:  # the gauges go back to zero
                    self.send(Outputs([], engine.stats()))
                    idle_reported = True
        except BaseException as exc:
            logger.exception("engine loop died")
            try:
                self.send(Failure(f"{error_name(exc)}: {exc}"))
            except OSError:
                pass
            return 1

    def _drain(self, block: bool) -> bool:
        """Apply the server's commands; wait for one when ``block``. True when the core should exit."""
        while True:
            try:
                command = self._commands.get(timeout=_IDLE_CHECK_S) if block else self._commands.get_nowait()
            except queue.Empty:
                return False
            block = False
            if isinstance(command, AddRequest):
                try:
                    self.engine.add_request(command.prompt, command.params, request_id=command.request_id,
                                            lora_request=command.lora_request)
                except Exception as exc:  # bad input for this request only
                    self.send(Rejected(command.request_id, error_name(exc), str(exc)))
            elif isinstance(command, AbortRequest):
                self.engine.abort_request(command.request_id)
                self._sent.pop(command.request_id, None)
            elif isinstance(command, Stop):
                return True
            elif command is None:
                logger.warning("the server closed its end of the channel; the engine core stops")
                return True
            else:  # a ServerTokenizer after the first: nothing to do with it
                logger.error("the server sent %s out of turn; ignored", type(command).__name__)

    def _send_outputs(self, outputs: list[Any]) -> None:
        deltas = []
        for output in outputs:
            sent = self._sent.get(output.request_id)
            first = sent is None
            if first:
                sent = self._sent[output.request_id] = [[0, 0, 0] for _ in output.outputs]
            choices = []
            for choice, counts in zip(output.outputs, sent):
                tokens, chars, logprobs = counts
                new_logprobs = None
                if choice.logprobs is not None:
                    new_logprobs = choice.logprobs[logprobs:]
                    counts[2] = len(choice.logprobs)
                choices.append(ChoiceDelta(choice.index, choice.token_ids[tokens:], choice.text[chars:],
                                           new_logprobs, choice.finish_reason))
                counts[0], counts[1] = len(choice.token_ids), len(choice.text)
            prompt = PromptInfo(output.prompt, output.prompt_token_ids, output.prompt_logprobs) if first else None
            deltas.append(RequestDelta(output.request_id, prompt, choices, output.finished, output.error,
                                       output.num_cached_tokens, output.embedding))
            if output.finished:
                del self._sent[output.request_id]
        self.send(Outputs(deltas, self.engine.stats()))

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception as exc:  # noqa: BLE001 - leaving anyway
                logger.warning("engine shutdown: %s: %s", error_name(exc), exc)
        self.sock.close()


def main(argv: list[str]) -> int:
    fd, spawned = int(argv[0]), float(argv[1]) if len(argv) > 1 else None
    # whatever prints goes to the log: the server's stdout is its own (its first line says where)
    os.dup2(2, 1)
    # Ctrl-C in a terminal reaches the whole process group: the server stops the core in order (stop message).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from pluginfer.core.config import EngineConfig  # while the server builds the config (spawned ahead)

    level, _, config = sys.stdin.read().partition("\n")
    if not config:
        # spawned ahead for a config that runs the engine elsewhere, or never came
        return 0
    logging.basicConfig(level=level, format="%(levelname)s %(name)s (engine core): %(message)s")
    sock = socket.socket(fileno=fd)
    core = EngineCore(EngineConfig.model_validate_json(config), sock)
    try:
        try:
            info = core.load(spawned)
        except Exception as exc:
            # the server re-raises it: the CLI prints pluginfer's own errors in one line
            from pluginfer.core.registry import PluginError

            ours = isinstance(exc, (ValueError, KeyError, FileNotFoundError, PluginError))
            if not ours:
                logger.exception("the engine could not start")
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            core.send(StartFailed("ValueError" if ours else error_name(exc), message))
            return 2
        core.send(info)
        return core.run()
    except OSError as exc:  # the server is gone
        logger.warning("the engine core lost its server: %s", exc)
        return 0
    finally:
        core.close()


def _exit(code: int) -> None:
    """Leave without the interpreter's finalization: the engine is shut down already, and native libraries'
    exit-time destructors racing their own threads occasionally aborted the process ("terminate called
    without an active exception", status -6) and made it take a second or more to go."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
