"""The native CPU kernel library (``csrc/``, one C file per op family): its sources, the C signatures, loading it
once per process, and the checks the wrappers of every kernel family share (``layer_ops``, ``panels``,
``quant``, ``half_linear``; ``ops`` registers them in the cpu backend's kernel table).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import torch

from pluginfer.backends.cpu.build import NativeKernelsUnavailable, build_library, cpu_features

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("attention.c", "norm.c", "activation.c", "rotary.c", "dequant.c", "panel_linear.c",
                             "quant_dot.c", "half_linear.c", "half_panel.c", "step_replay.c", "kv_quant_attention.c",
                             "prefill_attention.c"))

_pointer, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Every C function the wrappers call: (restype, argtypes); a recording packs arguments by these.
SIGNATURES = {
    "paged_decode_attention": (ctypes.c_int, [_pointer] * 6 + [_i64] * 7 + [_f32, _i64, _f32]),
    "prefill_attention_supported": (ctypes.c_int, []),
    # float32 query and output, float32 or 16-bit caches (the last argument: 0, or HALF_CODES)
    "paged_prefill_attention": (ctypes.c_int, [_pointer] * 7 + [_i64] * 7 + [_f32, _i64, _f32, ctypes.c_int]),
    "rms_norm": (None, [_pointer] * 4 + [_i64, _i64, _f32, _f32]),
    "silu_and_mul": (None, [_pointer, _pointer, _i64, _i64]),
    "gelu_tanh_and_mul": (None, [_pointer, _pointer, _i64, _i64]),
    "rotary_neox": (None, [_pointer] * 4 + [_i64] * 7),
    "ggml_dequantize_rows": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _i64, _pointer]),
    "ggml_dequantize_rows_bf16": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _i64, _pointer]),
    "grouped_dequantize": (ctypes.c_int, [ctypes.c_int, _pointer, _pointer, _pointer, ctypes.c_int, _pointer]
                           + [_i64] * 6 + [_pointer, ctypes.c_int]),
    "int4_dequantize_rows": (ctypes.c_int, [_pointer] * 3 + [_i64] * 3 + [_pointer, ctypes.c_int]),
    "panel_linear_supported": (ctypes.c_int, []),
    "panel_padded_outputs": (_i64, [_i64]),
    "pack_panels": (None, [_pointer, _pointer, _i64, _i64]),
    "panel_linear": (ctypes.c_int, [_pointer] * 4 + [_i64] * 3),
    "half_panel_supported": (ctypes.c_int, []),
    "half_panel_padded_outputs": (_i64, [_i64]),
    "pack_half_panels": (None, [_pointer, _pointer, _i64, _i64]),
    "half_panel_linear": (ctypes.c_int, [ctypes.c_int] + [_pointer] * 4 + [_i64] * 3),
    "quant_dot_supported": (ctypes.c_int, []),
    "quant_dot_max_threads": (ctypes.c_int, []),
    "quant_matmul": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _i64, _pointer]),
    "quant_panel_matmul": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _i64, _pointer]),
    "quant_dot_quantize": (ctypes.c_int, [_pointer, _i64, _i64, _pointer, _pointer]),
    "half_linear_supported": (ctypes.c_int, []),
    "half_linear": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _pointer, _pointer, ctypes.c_int]),
    "half_weight_linear": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _pointer, _pointer]),
    "gather_rows": (ctypes.c_int, [_pointer, _i64, _i64, _pointer, _i64, _i64, _pointer]),
    "scatter_rows": (ctypes.c_int, [_pointer, _i64, _pointer, _pointer, _i64, _i64, _i64]),
    "add_f32": (None, [_pointer] * 3 + [_i64] * 3),
    "to_f32": (None, [_pointer, ctypes.c_int, _pointer, _i64]),
    "from_f32": (None, [_pointer, ctypes.c_int, _pointer, _i64]),
    "copy_rows": (None, [_pointer, _i64, _i64, _i64, _pointer, _i64]),
    "add_bf16": (None, [_pointer] * 3 + [_i64] * 3),
    "add_f16": (None, [_pointer] * 3 + [_i64] * 3),
    "mul_scalar": (None, [_pointer] * 3 + [_i64, ctypes.c_int]),
    "step_replay": (_i64, [_pointer, _i64, _pointer]),
    # 16-bit activations (the last argument: HALF_CODES)
    "paged_decode_attention_16": (ctypes.c_int, [_pointer] * 6 + [_i64] * 7 + [_f32, _i64, _f32, ctypes.c_int]),
    # float32 query and output, 16-bit caches (a float32 model's --kv-cache-dtype float16/bfloat16)
    "paged_decode_attention_kv16": (ctypes.c_int, [_pointer] * 6 + [_i64] * 7 + [_f32, _i64, _f32, ctypes.c_int]),
    # quantized KV caches (the last argument: kv_quant.KINDS)
    "kv_quantize_rows": (ctypes.c_int, [_pointer] + [_i64] * 4 + [_pointer] * 3 + [ctypes.c_int]),
    "paged_attention_quantized": (ctypes.c_int, [_pointer] * 7 + [_i64] * 8 + [_f32, _i64, _f32, ctypes.c_int]),
    "kv_quant_attention_width": (ctypes.c_int, []),
    "rms_norm_16": (None, [_pointer] * 4 + [_i64, _i64, _f32, _f32, ctypes.c_int]),
    "silu_and_mul_16": (None, [_pointer, _pointer, _i64, _i64, ctypes.c_int]),
    "gelu_tanh_and_mul_16": (None, [_pointer, _pointer, _i64, _i64, ctypes.c_int]),
    "rotary_neox_16": (None, [_pointer] * 4 + [_i64] * 7 + [ctypes.c_int]),
}
# The 16-bit dtypes the norm, activation, rotary and decode attention kernels also take (csrc/half_values.h).
HALF_CODES = {torch.float16: 1, torch.bfloat16: 2}
# Entries of step_replay that are no function of this library: quant_matmul's (half_linear's) arguments behind the
# address of another library's kernel of that signature (amx_quant.c's tiles; amx_half.c's).
REPLAY_SIGNATURES = {
    "quant_matmul_at": (ctypes.c_int, [_pointer, ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _i64, _pointer]),
    "half_linear_at": (ctypes.c_int, [_pointer, ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _pointer, _pointer,
                                      ctypes.c_int]),
    "int8_gemm_at": (ctypes.c_int, [_pointer, _pointer, _i64, _i64, _pointer, _i64, _pointer, _pointer, _pointer]),
}


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The compiled kernel library (built once per source version, compiler and machine)."""
    if os.environ.get("PLUGINFER_NATIVE", "1") == "0":
        raise NativeKernelsUnavailable("disabled by PLUGINFER_NATIVE=0")
    library, info, path = build_library("cpu_kernels", SOURCES)
    loaded_build.update(info=info, path=path)
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


loaded_build: dict = {}  # "info" and "path": the BuildInfo and path of the library load() returned last


def fits_half(dtype: torch.dtype, *tensors: torch.Tensor) -> int | None:
    """The kernel's code for 16-bit ``dtype`` when every tensor has it and is contiguous, else None."""
    half = HALF_CODES.get(dtype)
    for tensor in tensors:
        if tensor.dtype != dtype or not tensor.is_contiguous():
            return None
    return half


def fits_f32(*tensors: torch.Tensor) -> bool:
    """Every tensor float32 and contiguous (a plain loop: these checks run several times per layer and step)."""
    for tensor in tensors:
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            return False
    return True


def contiguous_as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype`` and contiguous, the tensor itself when it is already (no call otherwise)."""
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


_logged: set[str] = set()


def log_once(level: int, message: str) -> None:
    """Log ``message`` at ``level`` the first time this process sees it, never again."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


# -- The AMX tile libraries (amx_half.py, amx_quant.py): built apart from load()'s, each with its own
# ``<name>_compiled()`` (1 where the compiler enabled AMX) and ``<name>_init()`` (0, or the errno of arch_prctl
# ARCH_REQ_XCOMP_PERM: Linux granting the tile state) ---------------------------------------------------------

AMX_ENV = "PLUGINFER_AMX"  # the switch of every AMX kernel

# (function name, restype, argtypes) of a library's kernel entries
Signature = tuple[str, object, list]


def amx_enabled() -> bool:
    """``PLUGINFER_AMX``: 1 (default) uses the tiles where the CPU has them, 0 takes the AVX-512 paths."""
    value = os.environ.get(AMX_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{AMX_ENV}={value!r}: expected 1 (use AMX tiles where the CPU has them) or 0")
    return value == "1"


def load_amx(name: str, sources: tuple[Path, ...], features: frozenset[str], extension: str,
             signatures: Iterable[Signature], what: str = "kernels") -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)`` with ``signatures`` set and the tile state granted, or ``(None, why)``: ``PLUGINFER_AMX=0``,
    a CPU without ``features`` (``extension`` names them, e.g. "AMX-INT8"), ``PLUGINFER_NATIVE=0``, a build that
    failed (``what``: "kernel" or "kernels", for the message), a compiler that did not enable the instructions or
    Linux refusing the tile state."""
    if not amx_enabled():
        return None, f"{AMX_ENV}=0"
    if not features <= cpu_features():
        return None, f"this CPU has no {extension}"
    if os.environ.get("PLUGINFER_NATIVE", "1") == "0":
        return None, "PLUGINFER_NATIVE=0"
    try:
        loaded = build_library(name, sources)[0]
    except (NativeKernelsUnavailable, OSError) as exc:
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


def load_amx_once(cache: list, unavailable: str, available: str, *args, **kwargs) -> ctypes.CDLL | None:
    """:func:`load_amx` (``args``, ``kwargs``) the first time, ``cache`` then ``[library]`` or ``[None]``, with one log
    line: ``unavailable`` with ``{why}`` filled in, or ``available``; later calls give ``cache[0]``."""
    if not cache:
        loaded, why = load_amx(*args, **kwargs)
        log_once(logging.INFO, unavailable.format(why=why) if loaded is None else available)
        cache.append(loaded)
    return cache[0]
