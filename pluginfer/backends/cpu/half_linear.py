"""The 16-bit GEMV (``csrc/half_linear.c``): bfloat16/float16 linears of a few rows, torch's GEMM above; also
float32 activations against 16-bit weights (a GGUF file's F16/BF16 tensors in a float32 model)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pluginfer.backends.cpu import amx_half, library, replay
from pluginfer.backends.cpu.library import log_once
from pluginfer.backends.cpu.replay import native

# What half_linear_supported() returns in C: the instruction set of the 16-bit GEMV.
HALF_LINEAR_ISAS = {1: "AVX512-BF16", 2: "AVX-512", 3: "AVX2 + F16C"}
HALF_LINEAR_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
# Rows above which half_linear hands the matmul back to torch's GEMM: where torch's oneDNN GEMM (AMX on
# Intel) catches up with the GEMV; later for float16, where torch's GEMM is slower.
HALF_LINEAR_MAX_ROWS = {torch.bfloat16: 6, torch.float16: 16}
# The same for float32 activations against a 16-bit weight (half_weight_linear), where the alternative is
# tiles of the weight widened to float32 for torch's float32 GEMM (quant/gguf.py's tiled_linear).
HALF_WEIGHT_MAX_ROWS = 24


def half_linear_isa() -> str | None:
    """The instruction set the 16-bit GEMV runs with here (``csrc/half_linear.c``), or None where the
    library was built for a CPU without AVX2 + F16C."""
    return HALF_LINEAR_ISAS.get(library.load().half_linear_supported())


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``x @ W^T + bias`` for a bfloat16/float16 CPU weight ``[out, in]`` (the checkpoint's layout) and
    ``x [..., in]`` of its dtype (``csrc/half_linear.c``): products exact in float32, summed in float32,
    rounded once to ``x``'s dtype (``out_dtype=torch.float32``: not rounded). A float32 ``x`` (and a float32
    ``bias``) with a 16-bit weight (a GGUF file's F16/BF16 tensor in a float32 model) gives float32: each
    weight widened exactly and multiplied by a fused multiply-add, the float32 ``x @ W.float().T`` up to
    the order of the sum, up to :data:`HALF_WEIGHT_MAX_ROWS` rows; on a CPU with AMX-BF16, the rows of
    ``amx_half.FLOAT_X_MIN_ROWS``..``FLOAT_X_MAX_ROWS`` go to the tiles with each x split exactly into three
    bfloat16 parts, the products exact, float32 sums (a float16 weight's low part times x's low part left
    out: each term < 2^-22 of its product; tests/backends/test_native_amx_half_float_x.py's bound). None:
    more rows than that or than :data:`HALF_LINEAR_MAX_ROWS` gives for the dtype, or dtypes, devices or
    layouts it does not handle; use ``F.linear``."""
    dtype = weight.dtype
    float_x = x.dtype == torch.float32
    if (dtype not in HALF_LINEAR_DTYPES or x.dtype not in (dtype, torch.float32) or weight.dim() != 2
            or x.dim() == 0 or weight.device.type != "cpu" or x.device.type != "cpu" or not weight.is_contiguous()
            or x.shape[-1] != weight.shape[1] or out_dtype not in (None, x.dtype, torch.float32)
            or (bias is not None and (bias.dtype != x.dtype or bias.shape != (weight.shape[0],)
                                      or bias.device.type != "cpu"))):
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= 2 and x.dtype == dtype and weight.shape[1] and amx_half.takes(dtype, rows):
        return _on_tiles(x, weight, bias, rows, out_dtype == torch.float32)
    if float_x and weight.shape[1] and amx_half.takes_float_x(dtype, rows):
        return _float_x_on_tiles(x, weight, bias, rows)
    limit = HALF_WEIGHT_MAX_ROWS if float_x else HALF_LINEAR_MAX_ROWS[dtype]
    if rows > limit or rows == 0 or weight.shape[1] == 0:
        return None
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out_float = float_x or out_dtype == torch.float32
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32 if out_float else dtype)
    if bias is not None:
        bias = bias.contiguous()
    bias_address = bias.data_ptr() if bias is not None else None
    if float_x:
        status = native().half_weight_linear(HALF_LINEAR_DTYPES[dtype], flat.data_ptr(), rows, weight.shape[1],
                                           weight.data_ptr(), weight.shape[0], bias_address, out.data_ptr())
    else:
        status = native().half_linear(HALF_LINEAR_DTYPES[dtype], flat.data_ptr(), rows, weight.shape[1],
                                    weight.data_ptr(), weight.shape[0], bias_address, out.data_ptr(), int(out_float))
    if status == -3:
        raise MemoryError("half_linear could not allocate its activation buffer")
    if status != 0:
        # -4: no kernel on this CPU (op() does not hand it out there)
        raise ValueError(f"half_linear: status {status} for {dtype} weights {tuple(weight.shape)}")
    return out


def _on_tiles(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
              out_float: bool) -> torch.Tensor:
    """:func:`half_linear` on ``amx_half.c``'s AMX bfloat16 tiles (from ``amx_half.MIN_ROWS`` to ``MAX_ROWS``
    rows); a recording calls that kernel, of another library, through its address."""
    dtype = weight.dtype
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32 if out_float else dtype)
    args = amx_half.call(dtype, x.reshape(rows, x.shape[-1]).contiguous(), rows, weight,
                         bias.contiguous() if bias is not None else None, out, out_float)
    recorder = replay.active_recording()
    if recorder is not None:
        replay.record_at(recorder, amx_half.library().amx_half_linear, *args, entry="half_linear_at")
    return out


def _float_x_on_tiles(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """:func:`half_linear` for float32 ``x`` against a 16-bit weight on the AMX tiles (``amx_half_weight_linear``,
    ``amx_half.FLOAT_X_MIN_ROWS``..``FLOAT_X_MAX_ROWS`` rows): x split exactly into three bfloat16 parts;
    recorded through ``half_linear_at`` as :func:`_on_tiles`."""
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
    args = amx_half.call_float_x(weight.dtype, x.reshape(rows, x.shape[-1]).contiguous(), rows, weight,
                                 bias.contiguous() if bias is not None else None, out)
    recorder = replay.active_recording()
    if recorder is not None:
        replay.record_at(recorder, amx_half.library().amx_half_weight_linear, *args, entry="half_linear_at")
    return out


def half_linear_op() -> Callable | None:
    """:func:`half_linear` where this CPU runs it, else None; says which, once per process."""
    isa = half_linear_isa()
    if isa is None:
        log_once(logging.WARNING, "16-bit linears: no bfloat16/float16 GEMV for this CPU (it needs AVX2 + F16C); "
                                   "torch's matmul")
        return None
    limits = HALF_LINEAR_MAX_ROWS
    log_once(logging.INFO, f"16-bit linears: native GEMV ({isa}) up to {limits[torch.bfloat16]} rows of bfloat16 "
                            f"and {limits[torch.float16]} of float16, torch's matmul above")
    if amx_half.library() is not None:
        # its own line: whether AMX bfloat16 tiles take amx_half.MIN_ROWS..MAX_ROWS
        log_once(logging.INFO, "float32 activations against 16-bit weights: AMX bfloat16 tiles (x split exactly "
                                "in three bfloat16) from "
                                + ", ".join(f"{amx_half.FLOAT_X_MIN_ROWS[d]} to {amx_half.FLOAT_X_MAX_ROWS[d]} rows "
                                            f"of {str(d)[6:]}" for d in amx_half.DTYPES)
                                + " (half_weight_linear's GEMV below)")
    return half_linear
