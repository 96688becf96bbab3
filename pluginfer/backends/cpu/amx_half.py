"""AMX bfloat16 tile kernel for 16-bit dense linears (``csrc/amx_half.c``), a library of its own.

On AMX-BF16 CPUs, :func:`half_linear.half_linear` hands matmuls of :data:`MIN_ROWS` to :data:`MAX_ROWS` rows to
it: the ``[out, in]`` weight read in place, products exact and summed in float32 (only the order of the sums
differs from the GEMV); float16 values are split exactly into two bfloat16. Built apart from ``library.py``'s,
so a compiler or CPU without AMX leaves the GEMV as it is, with one log line saying why.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pluginfer.backends.cpu import library as native_library

SOURCES = (Path(__file__).with_name("csrc") / "amx_half.c",)
ENV = native_library.AMX_ENV
DTYPES = {torch.bfloat16: 0, torch.float16: 1}
# Rows of x from which, and up to which, half_linear.half_linear takes the tiles, by weight dtype: the
# crossovers with the GEMV below and with torch's GEMM above (float16's GEMM in torch is slow, hence 2048).
MIN_ROWS = {torch.bfloat16: 4, torch.float16: 8}
MAX_ROWS = {torch.bfloat16: 96, torch.float16: 2048}
# The same for float32 x against a 16-bit weight (amx_half_weight_linear: x split exactly into three bfloat16,
# 3 products a pair for bfloat16 weights, 5 for float16), where the alternative is half_linear.c's
# half_weight_linear up to half_linear.HALF_WEIGHT_MAX_ROWS rows
# (one thread, CPU time, 32000x1024, the Q4_0 file's head, medians of 7, shared
# machine): float16 0.81x at 8 rows, 1.03x at 10, 1.13x at 12, 1.41x at 16, 1.53x at 24;
# bfloat16 0.87x at 4, 1.03x at 6, 1.44x at 8, 2.55x at 16 (ratios: the GEMV's time over the tiles'); above it,
# quant/gguf.py's tiles of the weight widened to float32 for torch's GEMM (the prefill), which the AMX tiles beat
# (one thread, CPU time, 5632x1024 and 1024x2816): float16 2.9-3.3x at 32 rows, 1.6-1.8x at 512, 1.2-1.7x at
# 2048; bfloat16 2.3-2.6x at 512, 1.5-2.1x at 2048.
FLOAT_X_MIN_ROWS = {torch.bfloat16: 8, torch.float16: 12}
FLOAT_X_MAX_ROWS = {torch.bfloat16: 2048, torch.float16: 2048}

# []: not tried yet; [None]: unavailable (logged once); [CDLL]: tile state granted
_library: list = []


def library() -> ctypes.CDLL | None:
    """The AMX kernel, or None where the CPU has no AMX-BF16, ``PLUGINFER_AMX=0``, the build fails or Linux
    refuses the tile state (arch_prctl ``ARCH_REQ_XCOMP_PERM``); says which, once per process."""
    if _library:
        return _library[0]
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    return native_library.load_amx_once(
        _library, "16-bit linears: no AMX bfloat16 tiles ({why}); the GEMV of half_linear.c and torch's GEMM",
        "16-bit linears: AMX bfloat16 tiles from "
        + ", ".join(f"{MIN_ROWS[d]} to {MAX_ROWS[d]} rows of {str(d)[6:]}" for d in DTYPES),
        "amx_half", SOURCES, frozenset({"amx_tile", "amx_bf16", "avx512_bf16"}), "AMX-BF16",
        [("amx_half_linear", ctypes.c_int,
          [ctypes.c_int, pointer, i64, i64, pointer, i64, pointer, pointer, ctypes.c_int]),
         ("amx_half_weight_linear", ctypes.c_int,
          [ctypes.c_int, pointer, i64, i64, pointer, i64, pointer, pointer, ctypes.c_int])], what="kernel")


def takes(dtype: torch.dtype, rows: int) -> bool:
    """Whether ``half_linear.half_linear`` hands ``rows`` rows of this weight dtype to the tiles here."""
    return (MIN_ROWS.get(dtype, 1 << 62) <= rows <= MAX_ROWS.get(dtype, 0)
            and (_library[0] if _library else library()) is not None)


def takes_float_x(dtype: torch.dtype, rows: int) -> bool:
    """Whether ``half_linear.half_linear`` hands ``rows`` float32 rows against this weight dtype to the
    tiles (:func:`call_float_x`)."""
    return (FLOAT_X_MIN_ROWS.get(dtype, 1 << 62) <= rows <= FLOAT_X_MAX_ROWS.get(dtype, 0)
            and (_library[0] if _library else library()) is not None)


def call_float_x(dtype: torch.dtype, flat: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor) -> tuple:
    """``out = flat [rows, in] @ weight^T + bias`` for float32 ``flat``, ``bias`` and ``out`` against a weight of
    ``dtype`` on the tiles, ``flat`` split exactly into three bfloat16 parts (``amx_half_weight_linear``; its
    comment and test_native_amx_half_float_x.py state the bound); tensors checked by the caller. Returns the
    C call's arguments after the dtype code's, for a recording (the signature is ``amx_half_linear``'s: the
    replay's ``half_linear_at``)."""
    args = (DTYPES[dtype], flat.data_ptr(), rows, weight.shape[1], weight.data_ptr(), weight.shape[0],
            bias.data_ptr() if bias is not None else None, out.data_ptr(), 1)
    status = _library[0].amx_half_weight_linear(*args)
    if status == -3:
        raise MemoryError("amx_half_weight_linear could not allocate its activation tiles")
    if status != 0:
        raise ValueError(f"amx_half_weight_linear: status {status} for {dtype} weights {tuple(weight.shape)}")
    return args


def call(dtype: torch.dtype, flat: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
         out: torch.Tensor, out_float: bool) -> tuple:
    """``out = flat [rows, in] @ weight^T + bias`` on the tiles (tensors checked by the caller: contiguous,
    of ``dtype``); :func:`library` must have returned the library. Returns the C call's arguments after
    the dtype code's, for a recording."""
    kernel = _library[0].amx_half_linear
    args = (DTYPES[dtype], flat.data_ptr(), rows, weight.shape[1], weight.data_ptr(), weight.shape[0],
            bias.data_ptr() if bias is not None else None, out.data_ptr(), int(out_float))
    status = kernel(*args)
    if status == -3:
        raise MemoryError("amx_half_linear could not allocate its activation tiles")
    if status != 0:
        raise ValueError(f"amx_half_linear: status {status} for {dtype} weights {tuple(weight.shape)}")
    return args


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``x @ W^T + bias`` on the tiles whatever the row count (tests and benchmarks; the engine gets here
    through ``half_linear.half_linear`` within :data:`MIN_ROWS`..:data:`MAX_ROWS`). None: no AMX here, or
    dtypes, devices or layouts the kernel does not handle."""
    dtype = weight.dtype
    if (library() is None or dtype not in DTYPES or x.dtype != dtype or weight.dim() != 2 or x.dim() == 0
            or not weight.is_cpu or not x.is_cpu or not weight.is_contiguous() or x.shape[-1] != weight.shape[1]
            or out_dtype not in (None, dtype, torch.float32)
            or (bias is not None and (bias.dtype != dtype or bias.shape != (weight.shape[0],) or not bias.is_cpu))):
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    out_float = out_dtype == torch.float32
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32 if out_float else dtype)
    if rows == 0 or weight.shape[1] == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    call(dtype, x.reshape(rows, x.shape[-1]).contiguous(), rows, weight,
         bias.contiguous() if bias is not None else None, out, out_float)
    return out


def linear_float_x(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``x @ W^T + bias`` for float32 ``x`` (and bias) against a 16-bit weight on the tiles whatever the row
    count, float32 out (tests and benchmarks; the engine gets here through ``half_linear.half_linear``
    within :data:`FLOAT_X_MIN_ROWS`..:data:`FLOAT_X_MAX_ROWS`). None: no AMX here, or dtypes, devices or
    layouts the kernel does not handle."""
    dtype = weight.dtype
    if (library() is None or dtype not in DTYPES or x.dtype != torch.float32 or weight.dim() != 2 or x.dim() == 0
            or not weight.is_cpu or not x.is_cpu or not weight.is_contiguous() or x.shape[-1] != weight.shape[1]
            or out_dtype not in (None, torch.float32)
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.shape[0],)
                                      or not bias.is_cpu))):
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
    if rows == 0 or weight.shape[1] == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    call_float_x(dtype, x.reshape(rows, x.shape[-1]).contiguous(), rows, weight,
                 bias.contiguous() if bias is not None else None, out)
    return out
