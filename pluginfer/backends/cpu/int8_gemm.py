"""The cpu backend's W8A8 kernels (``csrc/int8_gemm.c``, a library of its own): int8 weights repacked at load
(``w8a8_pack``) and multiplied with activations quantized per row at each call (``w8a8_linear``), on AVX-512
VNNI, AVX-VNNI, AVX2 or portable C, whichever this build of the library has (``PLUGINFER_CPU_ISA`` picks the
build). The ops and their torch references are the ``compressed-tensors`` quant method's
(``pluginfer/quant/compressed_tensors.py``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from pluginfer.backends.cpu import build, library
from pluginfer.backends.cpu.replay import active_recording, record_at

SOURCES = (Path(__file__).with_name("csrc") / "int8_gemm.c",)
ISAS = {3: "AVX-512 VNNI", 2: "AVX-VNNI", 1: "AVX2", 0: "portable C"}  # int8_gemm_isa()'s answers
MAX_INPUTS = 1 << 16  # the C kernel's I8_MAX_K: int32 sums stay exact below it

_pointer, _i64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "int8_gemm_isa": (ctypes.c_int, []),
    "int8_gemm_packed_bytes": (_i64, [_i64, _i64]),
    "int8_gemm_pack": (None, [_pointer, _i64, _i64, _pointer]),
    "int8_gemm_quantize": (ctypes.c_int, [_pointer, _i64, _i64, _pointer, _pointer]),
    "int8_gemm": (ctypes.c_int, [_pointer, _i64, _i64, _pointer, _i64, _pointer, _pointer, _pointer]),
}
_loaded: list = []  # [library or None], filled by the first load()


def load() -> ctypes.CDLL | None:
    """The library for this machine and ``PLUGINFER_CPU_ISA``, or None (logged once: why, and the torch path)."""
    if _loaded:
        return _loaded[0]
    loaded = None
    try:
        if os.environ.get("PLUGINFER_NATIVE", "1") == "0":
            raise build.NativeKernelsUnavailable("disabled by PLUGINFER_NATIVE=0")
        loaded = build.build_library("int8_gemm", SOURCES)[0]
        for name, (restype, argtypes) in SIGNATURES.items():
            function = getattr(loaded, name)
            function.restype, function.argtypes = restype, argtypes
        library.log_once(logging.INFO, f"W8A8 int8 GEMM: {ISAS[loaded.int8_gemm_isa()]}")
    except (build.NativeKernelsUnavailable, OSError) as exc:
        library.log_once(logging.WARNING, f"W8A8 int8 GEMM not built ({exc}); W8A8 linears take the torch "
                                           f"reference path (float64 matmul of the levels)")
    _loaded.append(loaded)
    return loaded


def isa() -> str | None:
    """Which variant runs here ("AVX-512 VNNI", "AVX-VNNI", "AVX2", "portable C"), or None: not built."""
    loaded = load()
    return None if loaded is None else ISAS[loaded.int8_gemm_isa()]


def op(name: str) -> object | None:
    """``w8a8_pack`` / ``w8a8_linear`` where the library loads, else None (both or neither)."""
    return {"w8a8_pack": w8a8_pack, "w8a8_linear": w8a8_linear}[name] if load() is not None else None


def w8a8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """int8 ``[n, k]`` -> this kernel's layout, int8 ``[blocks of 16 outputs, bytes per block]``
    (``csrc/int8_gemm.c``: 4-input steps of 64 bytes, then 16 int32 compensations)."""
    n, k = qweight.shape
    if qweight.dtype != torch.int8 or not 0 < k <= MAX_INPUTS:
        raise ValueError(f"w8a8_pack: needs int8 [n, k] with 0 < k <= {MAX_INPUTS}, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    lib = load()
    qweight = qweight.contiguous()
    packed = torch.empty(-(-n // 16), lib.int8_gemm_packed_bytes(1, k), dtype=torch.int8)
    lib.int8_gemm_pack(qweight.data_ptr(), n, k, packed.data_ptr())
    return packed


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """``x @ W^T + bias`` on the packed weights, bit for bit the reference's result (rows quantized per call)."""
    k = x.shape[-1]
    lib = load()
    if packed.shape != (-(-out_features // 16), lib.int8_gemm_packed_bytes(1, k)):
        raise ValueError(f"w8a8_linear: packed weights {tuple(packed.shape)} are not {out_features} outputs of "
                         f"{k} inputs")
    rows = x.numel() // k if k else 0
    flat = library.contiguous_as(x.reshape(rows, k), torch.float32)
    scale = library.contiguous_as(weight_scale, torch.float32)
    bias32 = None if bias is None else library.contiguous_as(bias, torch.float32)
    out = torch.empty(rows, out_features, dtype=torch.float32)
    args = (flat.data_ptr(), rows, k, packed.data_ptr(), out_features, scale.data_ptr(),
            None if bias32 is None else bias32.data_ptr(), out.data_ptr())
    status = lib.int8_gemm(*args)
    recorder = active_recording()
    if recorder is not None:  # a recorded step calls this library's kernel through its address
        record_at(recorder, lib.int8_gemm, *args, entry="int8_gemm_at")
    if status == -3:
        raise MemoryError("int8_gemm could not allocate its activation buffer")
    if status != 0:
        raise ValueError(f"int8_gemm: status {status} for {k} inputs")
    out = out.view(*x.shape[:-1], out_features)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization alone (for tests): float32 ``[m, k]`` -> (int8 levels ``[m, k]``,
    float32 scales ``[m]``)."""
    x = library.contiguous_as(x, torch.float32)
    m, k = x.shape
    lib = load()
    padded = -(-k // 4) * 4
    levels, scales = torch.empty(m, padded, dtype=torch.int8), torch.empty(m, dtype=torch.float32)
    status = lib.int8_gemm_quantize(x.data_ptr(), m, k, levels.data_ptr(), scales.data_ptr())
    if status != 0:
        raise ValueError(f"int8_gemm_quantize: status {status} for shape {tuple(x.shape)}")
    return levels[:, :k], scales
