"""Whether torchrun or mpiexec started this process, read from its environment, and how such a rank ends.

Torch-free, so the CLI can ask before any engine is built (``engine.launch`` holds the rest of the launchers).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def external_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """"torchrun" or "mpi" when that launcher started this process, else None."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or all(key in env for key in TORCHRUN_KEYS):
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    return None


def leave_launched_rank(code: int) -> None:
    """End a process that torchrun or mpiexec started, once its work is done; return anywhere else.

    The exit handlers run (the driver stops the other ranks, MPI is finalized), then the process
    leaves without the interpreter's finalization: the collectives' native threads (gloo's, MPI's)
    racing their libraries' exit-time destructors occasionally aborted a finished rank ("terminate
    called without an active exception", status -6), which the launcher reports as a failed job.
    The engine core process ends the same way (``engine_core._exit``).
    """
    if external_launcher() is None:
        return
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent() -> None:
    """A child's ``preexec_fn`` (Linux): SIGTERM when the process that spawned it goes away (PR_SET_PDEATHSIG):
    spawned ranks and the engine core process do not outlive their driver or server."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
