"""The engine core's process, spawned before its config exists: ``pluginfer serve`` starts it first thing.

The interpreter (with its end of a socket pair and the OpenMP environment torch reads once) waits on stdin
for its log level and config (``configure``), so its imports overlap the server's. ``start_engine`` takes it
(``take_prespawned``) when the config runs the core in a process of its own; otherwise it is discarded.
It imports only the standard library and two torch- and pydantic-free modules: it runs before anything else.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping

from pluginfer.core.config import DEFAULT_CORE_SPIN_COUNT
from pluginfer.engine.launcher_env import die_with_parent

logger = logging.getLogger(__name__)


class CoreProcess:
    """One spawned engine core interpreter and the server's end of its socket."""

    def __init__(self, spin_count: int = DEFAULT_CORE_SPIN_COUNT) -> None:
        self.spin_count = spin_count
        self.sock, child = socket.socketpair()
        self.spawned = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pluginfer.engine.engine_core", str(child.fileno()), repr(self.spawned)],
            stdin=subprocess.PIPE, pass_fds=(child.fileno(),),
            env=core_environment(spin_count, os.environ),
            preexec_fn=die_with_parent if sys.platform == "linux" else None)
        child.close()

    def configure(self, config_json: str, log_level: str) -> None:
        """Send the core its log level and config (once); it starts loading the model."""
        self.process.stdin.write(f"{log_level}\n{config_json}".encode())
        self.process.stdin.close()

    def discard(self) -> None:
        """Stop a process that was never configured (it exits at stdin's end; killed past a second)."""
        self.sock.close()
        if not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def core_environment(spin_count: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The engine core's environment: ``environ`` and how its idle OpenMP threads wait (``--core-spin-count``),
    unless ``environ`` already says (OMP_WAIT_POLICY or GOMP_SPINCOUNT: the user's own choice wins)."""
    env = dict(environ)
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env
    if spin_count == 0:
        env["OMP_WAIT_POLICY"] = "PASSIVE"  # every OpenMP runtime knows it; GOMP_SPINCOUNT is libgomp's
    else:
        env["GOMP_SPINCOUNT"] = str(spin_count)
    return env


# -- the one ``pluginfer serve`` spawns first thing ----------------------------------------------

_prespawned: CoreProcess | None = None


def prespawn() -> None:
    """Spawn the engine core's process now, with the default spin count, for ``take_prespawned``."""
    global _prespawned
    if _prespawned is not None:
        return
    try:
        _prespawned = CoreProcess()
    except OSError as exc:
        # start_engine spawns one when it needs it, and reports what fails then
        logger.debug("no engine core process spawned ahead: %s", exc)
        return
    atexit.register(discard_prespawned)


def take_prespawned(spin_count: int) -> CoreProcess | None:
    """The process ``prespawn`` started, if it was spawned with the environment ``spin_count`` asks for and is
    still running; else None (and it is discarded)."""
    global _prespawned
    process, _prespawned = _prespawned, None
    if process is None:
        return None
    if process.spin_count == spin_count and process.process.poll() is None:
        return process
    process.discard()
    return None


def discard_prespawned() -> None:
    """Stop the process ``prespawn`` started if no engine took it (the config runs the engine elsewhere)."""
    global _prespawned
    process, _prespawned = _prespawned, None
    if process is not None:
        process.discard()
