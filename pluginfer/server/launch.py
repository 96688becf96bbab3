"""Running the app: ``run_server`` (blocking, stops on SIGINT/SIGTERM) and ``BackgroundServer`` (a thread).

Shutdown order: stop accepting connections, stop the engine loop (in-flight requests end
with a 503, or an error event on a stream), then close the remaining connections.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pluginfer.core.config import EngineConfig, quant_activations
from pluginfer.engine.client import EngineClient
from pluginfer.server.core_client import CoreProcessClient

if TYPE_CHECKING:
    # imported where used: `pluginfer serve` starts the engine process before these load here
    from aiohttp import web  # imported late: the core process starts first

logger = logging.getLogger(__name__)


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, web.TCPSite, int]:
    """Listen on host:port (0: a free port); returns the runner, the site and the bound port."""
    from aiohttp import web

    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site, runner.addresses[0][1]


async def stop_site(runner: web.AppRunner, site: web.TCPSite,
                    engine: EngineClient | None) -> None:
    """Stop listening; stop the engine (if given), which ends in-flight requests; close the rest."""
    await site.stop()
    if engine is not None:
        await asyncio.to_thread(engine.shutdown)
    await runner.cleanup()


async def _serve(engine: EngineClient, config: EngineConfig) -> int:
    from pluginfer.engine.generation_config import describe, model_sampling_defaults
    from pluginfer.server.app import build_app
    from pluginfer.server.state import STATE

    app = build_app(engine, config)
    runner, site, port = await start_site(app, config.server.host, config.server.port)
    state = app[STATE]
    defaults = model_sampling_defaults(state.model_info.model_path)
    print(f"pluginfer: {describe(state.sampling, config.sampling, defaults)}", file=sys.stderr, flush=True)
    if config.quant_activations is not None or config.quant not in ("auto", "none") or config.model.endswith(".gguf"):
        mode, source = quant_activations(config.quant_activations)
        print(f"pluginfer: GGUF-quantized linears take {mode} activations ({source}; --quant-activations float: "
              "float32, exact as transformers; int8: as llama.cpp)", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    # SIGTERM (an orchestrator's stop) drains; SIGINT (Ctrl-C) stops at once
    terminated: list[int] = []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, lambda: (terminated.append(signal.SIGTERM), stop.set()))
    print(f"pluginfer: serving {state.model_name} "
          f"on http://{config.server.host}:{port}", flush=True)
    watcher = asyncio.create_task(_watch_engine(engine, stop))
    await stop.wait()
    died = watcher.done() and watcher.result()
    watcher.cancel()
    if terminated and not died and config.server.shutdown_timeout > 0:
        await _drain(app, engine, config.server.shutdown_timeout)
    print("pluginfer: shutting down", file=sys.stderr, flush=True)
    await stop_site(runner, site, engine)
    return 1 if died else 0


async def _drain(app: web.Application, engine: EngineClient, timeout: float) -> None:
    """Let the requests in flight finish, for at most ``timeout`` seconds or until a second signal; meanwhile
    new generation requests and /health get a 503 (a load balancer stops sending work here)."""
    from pluginfer.server.state import STATE

    app[STATE].draining = True
    loop = asyncio.get_running_loop()
    force = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, force.set)
    print(f"pluginfer: draining {engine.num_requests} request(s) in flight for at most {timeout:g} s "
          "(a second signal stops at once)", file=sys.stderr, flush=True)
    deadline = loop.time() + timeout
    while engine.num_requests and engine.is_alive and not force.is_set() and loop.time() < deadline:
        try:
            await asyncio.wait_for(force.wait(), 0.05)
        except TimeoutError:
            pass
    if engine.num_requests:
        print(f"pluginfer: {engine.num_requests} request(s) still in flight are ended", file=sys.stderr,
              flush=True)


async def _watch_engine(engine: EngineClient, stop: asyncio.Event, grace_s: float = 1.0) -> bool:
    """When the engine dies (e.g. a rank is lost): say why in one line, keep answering 503 for
    ``grace_s`` (load balancers see it), then stop the server; True if that happened."""
    while engine.is_alive:
        await asyncio.sleep(0.2)
    if stop.is_set():
        return False
    error = engine.error
    why = f"{type(error).__name__}: {error}" if error else "it stopped"
    print(f"pluginfer: the engine died ({why}); exiting", file=sys.stderr, flush=True)
    await asyncio.sleep(grace_s)
    stop.set()
    return True


def run_server(config: EngineConfig) -> int:
    """Load the model, serve until SIGINT or SIGTERM (0) or until the engine dies (1)."""
    engine = start_engine(config)
    try:
        return asyncio.run(_serve(engine, config))
    finally:
        engine.shutdown()


def start_engine(config: EngineConfig) -> EngineClient:
    """The engine core in a process of its own (``CoreProcessClient``) when it runs on one rank; else, and with
    ``PLUGINFER_ENGINE_PROCESS=0``, the step loop in a thread of this process (``AsyncEngine``).

    Several ranks stay in this process: the driver (rank 0) is this process, its workers its children.
    The core process starts first and loads the model while this process imports the server; one that
    ``pluginfer serve`` spawned before it built the config is taken when the config allows
    (``core_process.take_prespawned``)."""
    from pluginfer.engine.launcher_env import external_launcher
    from pluginfer.server.core_process import discard_prespawned, take_prespawned

    parallel = config.parallel
    client = None
    one_rank = parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1
    # engine/launch.py's detect_launcher, without importing it (it imports torch): not one rank of torchrun or mpiexec
    in_process = parallel.launcher == "inprocess" or (parallel.launcher == "auto" and
                                                      external_launcher(os.environ) is None)
    if os.environ.get("PLUGINFER_ENGINE_PROCESS", "1") != "0" and one_rank and in_process:
        client = CoreProcessClient(config, process=take_prespawned(config.server.core_spin_count))
    else:
        # `pluginfer serve` spawned one ahead: this config runs the engine here
        discard_prespawned()
    from pluginfer.server import app  # noqa: F401 - the server's own imports (no torch), while the core loads

    if client is None:
        if "core_spin_count" in config.server.model_fields_set:  # asked for, not the default
            logger.warning("--core-spin-count applies to the engine core process only; with the engine in this "
                           "process set OMP_WAIT_POLICY or GOMP_SPINCOUNT in its environment instead")
        from pluginfer.engine.async_engine import AsyncEngine
        from pluginfer.engine.engine import LLMEngine

        return AsyncEngine(LLMEngine(config)).start()
    client.start()
    times = client.startup_times
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in times.items() if name != "total")
    print(f"pluginfer: engine process {client.process.pid} ready in {times['total']:.2f} s ({phases}); "
          f"KV cache for {client.model_info.kv_tokens} tokens", file=sys.stderr, flush=True)
    return client


class BackgroundServer:
    """The app on its own event loop in a daemon thread (tests, notebooks); ``stop()`` ends it.

    The engine stays the caller's: several servers (e.g. with different keys) may share one.
    """

    def __init__(self, engine: EngineClient, config: EngineConfig) -> None:
        self.engine = engine
        self.config = config
        from pluginfer.server.app import build_app

        self.loop = asyncio.new_event_loop()
        self.app = build_app(engine, config)
        self._thread = threading.Thread(target=self.loop.run_forever, name="pluginfer-server", daemon=True)
        self._thread.start()
        self.runner, self.site, self.port = self._call(start_site(self.app, config.server.host,
                                                                  config.server.port))
        self.url = f"http://{config.server.host}:{self.port}"

    def _call(self, coroutine):
        future: Future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout=60)

    def stop(self) -> None:
        """Stop the server (not the engine)."""
        if self.loop.is_running():
            self._call(stop_site(self.runner, self.site, None))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
