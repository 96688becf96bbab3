"""AMX int8 tile kernels for quantized matmuls (``csrc/amx_quant.c``), a library of their own.

Where a CPU has AMX-INT8 (Sapphire Rapids and later), :func:`quant.ggml_quant_matmul` hands a matmul of
at least :data:`MIN_ROWS` rows of a Q4_0, Q8_0, Q4_K or Q6_K weight to these kernels instead of the
AVX-512 VNNI kernel of ``csrc/quant_dot.c``: the same activation quantization (per block of 32 to int8, bit
for bit) and the same exact integer block dot products, on 16 x 16 tiles; only the float32 sums of the
scaled block products are grouped differently (docs/quantization.md, "AMX"). The library is built apart
from ``library.py``'s, so a compiler without AMX support, a CPU without AMX or a kernel that refuses to
build leaves the VNNI kernels as they are, with one log line saying why.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu.library import contiguous_as

SOURCES = (Path(__file__).with_name("csrc") / "amx_quant.c",)
ENV = native_library.AMX_ENV
# gguf.GGMLQuantizationType -> the rows from which ggml_quant_matmul takes the tiles (Q4_0, Q8_0, Q4_K,
# Q6_K): below them the VNNI kernel is as fast or faster (the tiles cost the same from 1 to 16 rows).
MIN_ROWS = {2: 6, 8: 5, 12: 7, 14: 9}

# []: not tried yet; [None]: unavailable (logged once); [CDLL]: tile state granted
_library: list = []


def library() -> ctypes.CDLL | None:
    """The AMX kernels, or None where the CPU has no AMX-INT8, ``PLUGINFER_AMX=0``, the build fails or Linux
    refuses the tile state (arch_prctl ``ARCH_REQ_XCOMP_PERM``); says which, once per process."""
    if _library:
        return _library[0]
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    return native_library.load_amx_once(
        _library, "quantized linears: no AMX int8 tiles ({why}); the fused kernel of quant_dot.c takes every row count",
        f"quantized linears: AMX int8 tiles for Q4_0, Q8_0, Q4_K and Q6_K from {min(MIN_ROWS.values())} rows",
        "amx_quant", SOURCES, frozenset({"amx_tile", "amx_int8"}), "AMX-INT8",
        [("amx_quant_matmul", ctypes.c_int, [ctypes.c_int, pointer, i64, i64, pointer, i64, i64, pointer]),
         ("amx_quant_quantize", ctypes.c_int, [pointer, i64, i64, pointer, pointer])])


def takes(qtype: int, rows: int) -> bool:
    """Whether ``quant.ggml_quant_matmul`` hands ``rows`` rows of this GGML type to the tiles here."""
    return rows >= MIN_ROWS.get(qtype, 1 << 62) and (_library[0] if _library else library()) is not None


def call(qtype: int, flat: torch.Tensor, rows: int, cols: int, raw: torch.Tensor, out: torch.Tensor) -> None:
    """``out [rows, raw rows] = flat [rows, cols] @ W^T`` (float32, contiguous, checked by the caller) on
    the tiles; :func:`library` must have returned the library."""
    status = _library[0].amx_quant_matmul(qtype, flat.data_ptr(), rows, cols, raw.data_ptr(), raw.shape[0],
                                          raw.shape[1], out.data_ptr())
    if status == -3:
        raise MemoryError("amx_quant_matmul could not allocate its activation buffer")
    if status != 0:  # -2: the columns are not whole blocks filling each row
        raise ValueError(f"amx_quant_matmul: status {status} for GGML type {qtype}, {cols} columns, rows of "
                         f"{raw.shape[1]} bytes")


def quant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, cols: int) -> torch.Tensor | None:
    """``x @ W^T`` on the tiles whatever the row count (tests and benchmarks; the engine gets there
    through ``quant.ggml_quant_matmul`` from :data:`MIN_ROWS` rows). None: no AMX here, or a type, dtype,
    device or layout the kernels do not handle."""
    qtype = int(qtype)
    if (library() is None or qtype not in MIN_ROWS or raw.dtype != torch.uint8 or raw.dim() != 2
            or not raw.is_contiguous() or not raw.is_cpu or not x.is_cpu or not x.dtype.is_floating_point
            or x.shape[-1] != cols):
        return None
    rows = x.numel() // cols if cols else 0
    flat = contiguous_as(x.reshape(rows, cols), torch.float32)
    out = torch.empty(*x.shape[:-1], raw.shape[0], dtype=torch.float32)
    call(qtype, flat, rows, cols, raw, out)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernels' own activation quantization as int8 ``[rows, cols]`` and float32 ``[rows, cols / 32]``
    (tests: it equals ``quant.quantize_activations`` bit for bit), or None without AMX."""
    if library() is None:
        return None
    x = x.to(torch.float32).contiguous()
    rows, cols = x.shape
    levels = torch.empty(rows, cols, dtype=torch.int8)
    scales = torch.empty(rows, cols // 32, dtype=torch.float32)
    status = _library[0].amx_quant_quantize(x.data_ptr(), rows, cols, levels.data_ptr(), scales.data_ptr())
    if status != 0:
        raise ValueError(f"amx_quant_quantize: status {status} for shape {tuple(x.shape)}")
    return levels, scales
