"""The skip-or-fail rule of the AMX kernel tests (test_native_amx_half.py, test_native_amx_quant.py)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from pluginfer.backends.cpu import build as native_build
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native


def require_amx(library: Callable[[], object], features: set[str], extension: str, otherwise: str, what: str) -> None:
    """Skip where the native kernels do not load, the CPU lacks ``features`` (``extension``; ``otherwise``: what
    runs instead) or ``PLUGINFER_AMX=0``; fail where the CPU has them and ``library()`` (``what``) still gives
    None: a build that fails or a refused tile state."""
    reason = native.available()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")
    if not features <= native_build.cpu_features():
        pytest.skip(f"this CPU has no {extension} ({otherwise})")
    if os.environ.get(native_library.AMX_ENV, "1") == "0":
        pytest.skip("PLUGINFER_AMX=0 turns the AMX kernels off")
    if library() is None:
        pytest.fail(f"{what} did not load on a CPU with {extension} (the compiler, or Linux refused the tile "
                    "state): the log line of pluginfer.backends.cpu.library says which")
