"""What the AMX tile libraries (``amx_half.py``, ``amx_quant.py``) share: building one apart from
``library.load()``'s and asking Linux for the tile state, or saying why not.

Each library exports ``<name>_compiled()`` (1 where the compiler enabled the AMX instructions) and
``<name>_init()`` (0, or the errno of arch_prctl ``ARCH_REQ_XCOMP_PERM``); the caller logs the outcome.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from pluginfer.backends.cpu import build, library

ENV = "PLUGINFER_AMX"  # the switch of every AMX kernel

# (function name, restype, argtypes) of a library's kernel entries
Signature = tuple[str, object, list]


def enabled() -> bool:
    """``PLUGINFER_AMX``: 1 (default) uses the tiles where the CPU has them, 0 takes the AVX-512 paths."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 1 (use AMX tiles where the CPU has them) or 0")
    return value == "1"


def load(name: str, sources: tuple[Path, ...], features: frozenset[str], extension: str,
         signatures: Iterable[Signature], what: str = "kernels") -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)`` with ``signatures`` set and the tile state granted, or ``(None, why)``: ``PLUGINFER_AMX=0``,
    a CPU without ``features`` (``extension`` names them, e.g. "AMX-INT8"), ``PLUGINFER_NATIVE=0``, a build that
    failed (``what``: "kernel" or "kernels", for the message), a compiler that did not enable the instructions or
    Linux refusing the tile state."""
    if not enabled():
        return None, f"{ENV}=0"
    if not features <= build.cpu_features():
        return None, f"this CPU has no {extension}"
    if os.environ.get("PLUGINFER_NATIVE", "1") == "0":
        return None, "PLUGINFER_NATIVE=0"
    try:
        loaded = build.build_library(name, sources)[0]
    except (build.NativeKernelsUnavailable, OSError) as exc:
        return None, f"the AMX {what} did not build: {str(exc)[:300]}"
    for function_name, restype, argtypes in (
            (f"{name}_compiled", ctypes.c_int, []), (f"{name}_init", ctypes.c_int, []), *signatures):
        function = getattr(loaded, function_name)
        function.restype, function.argtypes = restype, argtypes
    status = getattr(loaded, f"{name}_init")() if getattr(loaded, f"{name}_compiled")() else -1
    if status == -1:
        return None, f"the compiler did not enable AMX-TILE/{extension} for this CPU"
    if status != 0:
        return None, f"Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(status)})"
    return loaded, None


def load_once(cache: list, unavailable: str, available: str, *args, **kwargs) -> ctypes.CDLL | None:
    """:func:`load` (``args``, ``kwargs``) the first time, ``cache`` then ``[library]`` or ``[None]``, with one log
    line: ``unavailable`` with ``{why}`` filled in, or ``available``; later calls give ``cache[0]``."""
    if not cache:
        loaded, why = load(*args, **kwargs)
        library.log_once(logging.INFO, unavailable.format(why=why) if loaded is None else available)
        cache.append(loaded)
    return cache[0]
