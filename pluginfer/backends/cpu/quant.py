"""Native kernels of quantized weights: GGML, GPTQ/AWQ and int4 dequantization to float32 or bfloat16 tiles,
the fused int8-activation GGML matmul (``csrc/quant_dot.c``, AMX tiles through ``amx_quant``), and the policy
that picks the tiles' dtype and the rows each path takes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from pluginfer.backends.cpu import build, library
from pluginfer.backends.cpu.library import contiguous_as, log_once
from pluginfer.backends.cpu.replay import active_recording, native, record_at
from pluginfer.core.config import QUANT_ACTIVATIONS_ENV  # noqa: F401 - read here by the tests
from pluginfer.core.config import quant_activations as resolve_quant_activations

# The dtypes the dequantization kernels write: float32, or bfloat16 rounded to nearest even from it.
TILE_DTYPES = (torch.float32, torch.bfloat16)


def _output(out: torch.Tensor | None, rows: int, cols: int, op: str, dtype: torch.dtype | None) -> torch.Tensor:
    """A float32 or bfloat16 ``[rows, cols]`` result: new (``dtype``, float32 by default), or a view of the
    front of a caller's reusable buffer, whose dtype is the result's (``dtype``, if given, must agree)."""
    if out is None:
        dtype = torch.float32 if dtype is None else dtype
        if dtype not in TILE_DTYPES:
            raise ValueError(f"{op} writes float32 or bfloat16, not {dtype}")
        return torch.empty(rows, cols, dtype=dtype)
    if (out.dtype not in TILE_DTYPES or dtype not in (None, out.dtype) or not out.is_contiguous()
            or out.numel() < rows * cols):
        raise ValueError(f"{op} needs a contiguous {'float32 or bfloat16' if dtype is None else dtype} out of "
                         f"{rows * cols} elements, got {out.dtype} {tuple(out.shape)}")
    return out.view(-1)[:rows * cols].view(rows, cols)


# gguf.GGMLQuantizationType values ggml_dequantize_rows handles (Q4_0 ... Q8_0, Q2_K ... Q6_K).
GGML_DEQUANTIZABLE = frozenset({2, 3, 6, 7, 8, 10, 11, 12, 13, 14})


def ggml_dequantize(raw: torch.Tensor, qtype: int, cols: int, out: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Raw GGML blocks uint8 ``[rows, row_bytes]`` to float32 ``[rows, cols]`` (into ``out`` when
    given, a contiguous tensor of at least ``rows * cols`` elements), bit-exact with
    ``ggml_blocks.dequantize``. bfloat16 (``dtype``, or ``out``'s dtype): in one pass, each value that
    float32 value rounded to nearest even, equal to ``ggml_blocks.dequantize(...).to(torch.bfloat16)``
    bit for bit. None: a type (or a non-contiguous ``raw``) this kernel does not handle; use the torch path."""
    qtype = int(qtype)
    rows = raw.shape[0]
    if qtype not in GGML_DEQUANTIZABLE or raw.dtype != torch.uint8 or not raw.is_contiguous():
        return None
    out = _output(out, rows, cols, "ggml_dequantize", dtype)
    kernel = native().ggml_dequantize_rows if out.dtype == torch.float32 else native().ggml_dequantize_rows_bf16
    status = kernel(qtype, raw.data_ptr(), rows, raw.shape[1], cols, out.data_ptr())
    if status != 0:  # the columns are not whole blocks filling each row
        raise ValueError(f"ggml_dequantize: {cols} columns of GGML type {qtype} do not fit rows of "
                         f"{raw.shape[1]} bytes")
    return out


# Scale dtypes grouped_dequantize reads, by the code its C kernel takes.
SCALE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def grouped_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                       bits: int, start: int, stop: int, out: torch.Tensor | None = None,
                       dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Output columns ``start:stop`` of the GPTQ/AWQ layout (``pluginfer.quant.packing``) as float32
    ``[in, stop - start]`` (into ``out`` when given, a contiguous tensor of at least that many
    elements), bit-exact with ``GroupQuantLinear.dequantize_columns`` in float32 (which returns its
    transpose); bfloat16 (``dtype`` or ``out``'s): those values rounded to nearest even, in one pass.
    ``g_idx`` must name groups of ``scales``, as loading checks. None: bits, dtypes,
    devices or strides this kernel does not handle; use the torch path."""
    if bits not in (4, 8):
        return None
    pack = 32 // bits
    in_features, rows, groups = qweight.shape[0] * pack, stop - start, scales.shape[0]
    tensors = (qweight, qzeros, scales) if g_idx is None else (qweight, qzeros, scales, g_idx)
    if (scales.dtype not in SCALE_TYPES or qweight.dtype != torch.int32 or qzeros.dtype != torch.int32
            or (g_idx is not None and (g_idx.dtype != torch.int32 or g_idx.numel() != in_features))
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or groups == 0 or in_features % groups or scales.shape[1] != qweight.shape[1]
            or qzeros.shape[0] != groups or start % pack or stop % pack
            or not 0 <= start < stop <= qweight.shape[1] or qzeros.shape[1] * pack < stop):
        return None
    out = _output(out, in_features, rows, "grouped_dequantize", dtype)
    status = native().grouped_dequantize(
        bits, qweight.data_ptr(), qzeros.data_ptr(), scales.data_ptr(), SCALE_TYPES[scales.dtype],
        g_idx.data_ptr() if g_idx is not None else None, in_features, qweight.shape[1], groups, qzeros.shape[1],
        start, stop, out.data_ptr(), int(out.dtype == torch.bfloat16))
    if status == -3:
        raise MemoryError("grouped_dequantize could not allocate its per-group buffers")
    if status != 0:
        raise ValueError(f"grouped_dequantize: status {status} for bits {bits}, columns {start}:{stop}")
    return out


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Rows of the int4 method's layout (``pluginfer.quant.int4``) as float32 ``[rows, in]`` (into ``out``
    when given, a contiguous tensor of at least that many elements), bit-exact with
    ``int4.dequantize_int4``; bfloat16 (``dtype`` or ``out``'s): those values rounded to nearest even, in
    one pass. None: dtypes, devices, strides or shapes this kernel does not handle."""
    rows, in_features = qweight.shape[0], qweight.shape[1] * 2
    tensors = (qweight, scales, zeros)
    if (qweight.dtype != torch.uint8 or scales.dtype != torch.float16 or zeros.dtype != torch.float16
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or scales.shape != zeros.shape or scales.shape[0] != rows or scales.shape[1] == 0
            or in_features % scales.shape[1] or (in_features // scales.shape[1]) % 2):
        return None
    out = _output(out, rows, in_features, "int4_dequantize", dtype)
    native().int4_dequantize_rows(qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), rows, in_features,
                                in_features // scales.shape[1], out.data_ptr(), int(out.dtype == torch.bfloat16))
    return out


# gguf.GGMLQuantizationType values quant_matmul handles (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
QUANT_MATMUL_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
_CONFIGURED_ACTIVATIONS: list[str | None] = [None]  # the engine config's quant_activations, as CpuBackend sets it


def configure_quant_activations(mode: str | None) -> None:
    """The engine config's ``quant_activations`` (None: ``PLUGINFER_QUANT_ACTIVATIONS``, else int8)."""
    _CONFIGURED_ACTIVATIONS[0] = mode


def quant_activations() -> tuple[str, str]:
    """(``int8`` or ``float``, what chose it): the config's, else ``PLUGINFER_QUANT_ACTIVATIONS``, else int8."""
    return resolve_quant_activations(_CONFIGURED_ACTIVATIONS[0])


def ggml_quant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, cols: int) -> torch.Tensor | None:
    """``x @ W^T`` for float ``x [..., cols]`` and ``W`` the raw GGML blocks uint8 ``[rows, row_bytes]``,
    without a float copy of ``W`` (``csrc/quant_dot.c``): each row of ``x`` is quantized per block of
    32 to int8 with a float32 scale, as llama.cpp's Q8_0, and multiplied with the weights' levels in
    integers; from a few rows up, on a CPU with AMX, on int8 tiles (``backends/cpu/amx_quant.py``), and
    without them, from :func:`panel_min_rows` rows (2-8 by type and instruction set), by the panel GEMM
    (``csrc/quant_panel.h``: each weight block decoded once per call and reused by every row).
    The result has ``x``'s dtype (float16/bfloat16 ``x`` is converted to float32 and back).
    None: a type, dtype, device or layout it does not handle; use the dequantizing path."""
    qtype = int(qtype)
    # (is_cpu, not device.type: this runs for every linear of every decode step, where each check shows)
    if (qtype not in QUANT_MATMUL_TYPES or raw.dtype != torch.uint8 or raw.dim() != 2 or not raw.is_contiguous()
            or not raw.is_cpu or not x.is_cpu or not x.dtype.is_floating_point or x.shape[-1] != cols):
        return None
    if x.dim() == 2:  # the engine's flat [tokens, features]
        rows = x.shape[0]
        flat = contiguous_as(x, torch.float32)
        out = torch.empty((rows, raw.shape[0]), dtype=torch.float32)
    else:
        rows = x.numel() // cols if cols else 0
        flat = contiguous_as(x.reshape(rows, cols), torch.float32)
        out = torch.empty(*x.shape[:-1], raw.shape[0], dtype=torch.float32)
    amx = False
    if rows >= 2:  # AMX int8 tiles from amx_quant.MIN_ROWS rows, where the CPU has them
        from pluginfer.backends.cpu import amx_quant
        amx = amx_quant.takes(qtype, 1 << 61)  # this type on the tiles (fewer rows: quant_dot.c's, as before)
        if amx_quant.takes(qtype, rows):
            amx_quant.call(qtype, flat, rows, cols, raw, out)
            recorder = active_recording()
            if recorder is not None:  # the tiles' kernel lives in its own library: replayed through its address
                record_at(recorder, amx_quant.library().amx_quant_matmul, qtype, flat.data_ptr(), rows, cols,
                           raw.data_ptr(), raw.shape[0], raw.shape[1], out.data_ptr())
            return out if x.dtype == torch.float32 else out.to(x.dtype)
    if rows >= panel_min_rows()[qtype] and not amx:  # many rows, no AMX tiles: the panel GEMM
        status = native().quant_panel_matmul(qtype, flat.data_ptr(), rows, cols, raw.data_ptr(), raw.shape[0],
                                             raw.shape[1], out.data_ptr())
    else:
        status = native().quant_matmul(qtype, flat.data_ptr(), rows, cols, raw.data_ptr(), raw.shape[0], raw.shape[1],
                                     out.data_ptr())
    if status == -3:
        raise MemoryError("quant_matmul could not allocate its activation buffer")
    if status != 0:  # -2: the columns are not whole blocks filling each row; -4: no kernel on this CPU
        raise ValueError(f"quant_matmul: status {status} for GGML type {qtype}, {cols} columns, rows of "
                         f"{raw.shape[1]} bytes")
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization of :func:`ggml_quant_matmul` alone (for tests): float32 ``[rows, cols]``
    to int8 levels ``[rows, cols]`` and float32 scales ``[rows, cols / 32]``."""
    x = x.to(torch.float32).contiguous()
    rows, cols = x.shape
    levels = torch.empty(rows, cols, dtype=torch.int8)
    scales = torch.empty(rows, cols // 32, dtype=torch.float32)
    status = native().quant_dot_quantize(x.data_ptr(), rows, cols, levels.data_ptr(), scales.data_ptr())
    if status != 0:
        raise ValueError(f"quantize_activations: status {status} for shape {tuple(x.shape)}")
    return levels, scales


class TileDequantize:
    """A tile dequantization op (``grouped_dequantize``, ``int4_dequantize``) carrying the cpu backend's
    choice of ``tile_dtype``: the dtype a quantized linear's tiles are dequantized to and multiplied in
    (``quant.tiled.tiled_linear``; float32 inputs are rounded to it once per call, outputs are float32)."""

    def __init__(self, dequantize: Callable, tile_dtype: torch.dtype) -> None:
        self.dequantize, self.tile_dtype = dequantize, tile_dtype
        # float32 x of fewer rows keeps float32 tiles (bfloat16 ones would round it for no gain in speed)
        self.tile_dtype_min_rows = TILE_DTYPE_MIN_ROWS.get(tile_dtype, 0)

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor | None:
        return self.dequantize(*args, **kwargs)


class GGMLDequantize(TileDequantize):
    """The ``ggml_dequantize`` op where the fused matmul runs too, or where tiles are bfloat16: calls
    :func:`ggml_dequantize`, and ``quant_matmul`` is the fused int8-activation matmul for the same blocks
    (``op("ggml_quant_matmul")``, or None), which ``ggml_blocks.ggml_linear`` takes up to
    ``quant_matmul_max_rows`` rows of ``x``, and tiles in ``tile_dtype`` above. Where the fused kernel is off
    (no AVX2, ``PLUGINFER_QUANT_ACTIVATIONS=float``) and the tiles are float32 the op is plain
    :func:`ggml_dequantize`."""

    def __init__(self, dequantize: Callable, quant_matmul: Callable | None,
                 tile_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(dequantize, tile_dtype)
        self.quant_matmul = quant_matmul
        # GGML type -> rows of x up to which ggml_linear takes quant_matmul
        self.quant_matmul_max_rows = quant_matmul_max_rows(tile_dtype) if quant_matmul is not None else {}

    def __call__(self, raw: torch.Tensor, qtype: int, cols: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.dequantize(raw, qtype, cols, out)


# What quant_dot_supported() returns in C: the instruction set the fused matmul was built for.
QUANT_DOT_ISAS = {1: "AVX-512 VNNI", 2: "AVX2 + AVX-VNNI", 3: "AVX2"}


def quant_dot_isa() -> str | None:
    """The instruction set the fused quantized matmul runs with here (``csrc/quant_dot.c``), or None
    where the library was built for a CPU without AVX2."""
    return QUANT_DOT_ISAS.get(library.load().quant_dot_supported())


# Rows of x from which ggml_quant_matmul hands a step to the panel GEMM (where AMX tiles do not take it), by
# the instruction set it was built for and GGML type: one core, CPU time. AVX-512 VNNI, 1024 x 1024 and the
# 0.5B llama's 4864 x 896 and 896 x 4864 linears: the panel as fast as quant_dot.c's few-row tiles at 3 rows
# (Q4_0), 4 (Q4_K, Q6_K), 5-6 (Q8_0), 5-8 (the types decoded per column, then transposed); 1.9-2.2x theirs at
# 16 rows, 2.5-3.2x at 512. AVX2, 2816 x 1024 and 1024 x 2816, the first row count from which the panel is as
# fast in every run (vpmaddubsw, two runs): 2 (Q4_0, Q5_K), 3 (Q8_0: its sign trick takes twice the operations;
# Q4_K, Q6_K, Q5_0, Q5_1), 4 (Q4_1); 1.3-1.4x at 16 rows for Q8_0, 1.7-2.5x the others. With AVX-VNNI (vpdpbusd,
# three runs): 2 (Q4_0, Q5_K), 3 (Q8_0, Q4_K, Q6_K), 4 (Q4_1, Q5_0, Q5_1); 1.9-2.5x at 16 rows.
PANEL_MIN_ROWS = {
    "AVX-512 VNNI": {2: 3, 8: 6, 12: 4, 14: 4, 3: 8, 6: 8, 7: 8, 13: 8},
    "AVX2": {2: 2, 8: 3, 12: 3, 14: 3, 3: 4, 6: 3, 7: 3, 13: 2},
    "AVX2 + AVX-VNNI": {2: 2, 8: 3, 12: 3, 14: 3, 3: 4, 6: 4, 7: 4, 13: 2},
}
_PANEL: list[dict[int, int]] = []  # this library's PANEL_MIN_ROWS, once asked


def panel_min_rows() -> dict[int, int]:
    """GGML type -> rows of x from which the panel GEMM takes a step here; every type at 2**62 where it has no
    panel GEMM (no AVX2)."""
    if not _PANEL:
        _PANEL.append(PANEL_MIN_ROWS.get(quant_dot_isa(), dict.fromkeys(QUANT_MATMUL_TYPES, 1 << 62)))
    return _PANEL[0]


def quant_dot_supported() -> bool:
    """Whether this CPU runs the fused quantized matmul (AVX-512 VNNI, or AVX2)."""
    return quant_dot_isa() is not None


def quant_matmul_op() -> Callable | None:
    """:func:`ggml_quant_matmul` where this CPU runs it and ``PLUGINFER_QUANT_ACTIVATIONS`` is not
    ``float``; else None. Says which, once per process."""
    mode, source = quant_activations()
    if mode == "float":
        log_once(logging.INFO, f"quantized linears: {source}=float, float32 activations against dequantized tiles")
        return None
    if not quant_dot_supported():
        log_once(logging.WARNING, "quantized linears: no fused int8-activation kernel for this CPU (it needs "
                                   "AVX2); every step dequantizes tiles for a GEMM")
        return None
    log_once(logging.INFO, f"quantized linears: fused int8-activation kernel ({quant_dot_isa()}) for Q4_0, "
                            f"Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; its many-row int8 panel GEMM where AMX "
                            f"tiles do not take a step")
    return ggml_quant_matmul


QUANT_TILES_ENV = "PLUGINFER_QUANT_TILES"
# Rows of x up to which a GGML linear takes the fused int8-activation matmul against bfloat16 tiles on the AMX
# GEMM above it, measured on one core, by CPU time: the AVX-512 VNNI kernel wins up to ~48 (Q4_K, Q8_0, Q4_0:
# 0.86-1.1x at 48 rows, 1.0-1.4x at 64), and the AMX int8 kernel (amx_quant.py) up to ~128 for Q4_0 and Q4_K
# (0.92-1.0x at 128, 1.2x at 192) and ~256 for Q8_0 (0.94-1.16x at 256, 1.14-1.33x at 384); Q6_K not measured,
# given Q4_K's. Against float32 tiles the panel GEMM wins at every row count (AVX2 or AVX-512 VNNI, 3x at 512),
# but for Q8_0 on AVX2 without AVX-VNNI: its sign trick takes twice the operations, and dequantize + float32
# GEMM takes its steps past 128 rows (a 512-token prefill at 114-117 tok/s on the panel, 116-124 on the tiles with
# MKL on AVX2, as on such a CPU; 137.6 against 161.6 with MKL's AVX-512 GEMM).
FUSED_MAX_ROWS_BEFORE_BFLOAT16_TILES = 48
PANEL_MAX_ROWS = 1 << 40
AVX2_Q8_0_MAX_ROWS = 128
# With bfloat16 tiles, for the GGML types the AMX int8 kernel takes (Q4_0, Q8_0, Q4_K, Q6_K).
AMX_INT8_MAX_ROWS = {2: 128, 8: 256, 12: 128, 14: 128}


def quant_matmul_max_rows(tile_dtype: torch.dtype) -> dict[int, int]:
    """GGML type -> the rows of x up to which ``ggml_blocks.ggml_linear`` takes the fused matmul, where the
    rows above it dequantize tiles to ``tile_dtype``."""
    if tile_dtype == torch.float32:
        limits = dict.fromkeys(QUANT_MATMUL_TYPES, PANEL_MAX_ROWS)
        if quant_dot_isa() == "AVX2":
            limits[8] = AVX2_Q8_0_MAX_ROWS
        return limits
    from pluginfer.backends.cpu import amx_quant

    return {qtype: AMX_INT8_MAX_ROWS[qtype] if amx_quant.takes(qtype, AMX_INT8_MAX_ROWS.get(qtype, 0))
            else FUSED_MAX_ROWS_BEFORE_BFLOAT16_TILES for qtype in QUANT_MATMUL_TYPES}
# Rows of float32 x from which tiles take that dtype (one core, CPU time, float32 tiles
# against bfloat16: 0.9-1.3x as fast at 16-24 rows, 1.1-1.6x at 32, 1.3-1.7x at 48, 3.4-3.8x at 512).
TILE_DTYPE_MIN_ROWS = {torch.bfloat16: 32}


def bfloat16_gemm_is_fast() -> bool:
    """Whether torch's bfloat16 GEMM runs on AMX here (AMX-BF16 and oneDNN): several times its float32 GEMM."""
    return ("amx_bf16" in build.cpu_features() and library.amx_enabled()
            and torch.backends.mkldnn.is_available())


def tile_dtype() -> torch.dtype:
    """The dtype the cpu backend's quantized linears dequantize their tiles to (the steps the fused int8
    kernel does not take): bfloat16 where :func:`bfloat16_gemm_is_fast`, else float32.
    ``PLUGINFER_QUANT_TILES`` (``auto``, ``float32``, ``bfloat16``) overrides it, and
    ``PLUGINFER_QUANT_ACTIVATIONS=float`` keeps float32 (the exact path). Says which, once per process."""
    mode = os.environ.get(QUANT_TILES_ENV, "auto").lower()
    if mode not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"{QUANT_TILES_ENV}={mode!r}: expected 'auto' (the default), 'float32' or 'bfloat16'")
    if quant_activations()[0] == "float":
        return torch.float32
    if mode == "float32" or (mode == "auto" and not bfloat16_gemm_is_fast()):
        why = (f"{QUANT_TILES_ENV}=float32" if mode == "float32" else
               f"{library.AMX_ENV}=0" if not library.amx_enabled() else "no AMX-BF16 for torch's bfloat16 GEMM")
        log_once(logging.INFO, f"quantized linears: tiles dequantized to float32 for torch's float32 GEMM ({why})")
        return torch.float32
    why = f"{QUANT_TILES_ENV}=bfloat16" if mode == "bfloat16" else "AMX-BF16"
    log_once(logging.INFO, f"quantized linears: tiles dequantized to bfloat16 for torch's bfloat16 GEMM ({why}), "
                            f"from {TILE_DTYPE_MIN_ROWS[torch.bfloat16]} rows and past the fused kernel's "
                            f"{FUSED_MAX_ROWS_BEFORE_BFLOAT16_TILES} (128-256 on AMX int8 tiles); "
                            f"{QUANT_TILES_ENV}=float32 keeps float32 tiles")
    return torch.bfloat16

