"""Every op the cpu backend implements, registered in its kernel table: the one place to look.

:data:`NATIVE` maps each op to the Python wrapper of its C kernel and names its file in ``csrc/`` (one per op
family). Dense layouts (``dense.py``) are always registered; native kernels only where the library loads,
chosen at each lookup (``KernelTable.register_choice``) since they depend on the CPU and on settings read then.
The library is compiled on first use (``build.py``), loaded through ctypes (``library.py``); without it (or
with ``PLUGINFER_NATIVE=0``) the backend keeps its torch path and logs once why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import (
    amx_half,
    build,
    half_linear,
    half_panels,
    int8_gemm,
    layer_ops,
    library,
    panels,
    quant,
)
from pluginfer.core.kernels import KernelTable, define_op

# What a log line about missing kernels tells the user to do.
HOW_TO_GET = "install a C compiler (gcc or clang; CC picks one) and restart; PLUGINFER_NATIVE=0 silences this"


@define_op
def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` float32 weight -> panels of 16 outputs ``[padded out / 16, in, 16]``, zero rows padding
    ``out`` to a multiple of 64 (the cpu backend's own layout for :func:`panel_linear`)."""
    out_features, in_features = weight.shape
    padded = torch.zeros(-(-out_features // 64) * 64, in_features, dtype=weight.dtype)
    padded[:out_features] = weight
    return padded.view(-1, 16, in_features).transpose(1, 2).contiguous()


@define_op
def panel_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` over any leading dims of float32 ``x``, W packed by :func:`pack_panels`."""
    weight = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]
    return F.linear(x, weight, bias)


def register(table: KernelTable, backend: object) -> None:
    """Fill ``table`` with the cpu backend's kernels: its dense layouts, and the native kernels chosen at each
    lookup while ``backend.native_kernels`` is on."""
    from pluginfer.backends.cpu.dense import CpuDenseLayouts

    layouts = CpuDenseLayouts(backend)
    table.register("dense_layout", layouts.dense_layout)
    table.register("dense_pack", layouts.dense_pack)
    table.register("dense_linear", layouts.dense_linear)
    for name in NATIVE:
        table.register_choice(name, functools.partial(_native_while_on, backend, name))


def _native_while_on(backend: object, name: str) -> Callable | None:
    return op(name) if backend.native_kernels else None


def report() -> str:
    """One line for `pluginfer plugins`: which kernels loaded, for which instruction set, or why not."""
    reason = available()
    if reason is not None:
        return f"native kernels: not loaded ({reason}); torch path"
    loaded, info = library.load(), library.loaded_build["info"]
    isa = "AVX-512" if loaded.panel_linear_supported() else info.machine
    fused_isa = quant.QUANT_DOT_ISAS.get(loaded.quant_dot_supported())
    fused = f"int8 GGML matmul ({fused_isa})" if fused_isa else "no fused int8 GGML matmul"
    half_isa = half_linear.HALF_LINEAR_ISAS.get(loaded.half_linear_supported())
    fused += f"; 16-bit GEMV ({half_isa})" if half_isa else "; no 16-bit GEMV"
    if half_panels.supported():
        fused += "; GGUF F16/BF16 weights " + ("as stored (AMX tiles)" if amx_half.library() is not None
                                               else "packed in 16-bit panels")
    mode, source = quant.quant_activations()
    fused += f"; GGUF linears take {mode} activations ({source}; --quant-activations int8 or float)"
    threads = "OpenMP" if info.openmp else "single-threaded (no OpenMP)"
    path = library.loaded_build["path"]
    prefill = ("prefill attention" if loaded.prefill_attention_supported()
               else "prefill attention by torch's SDPA (its kernel needs AVX-512)")
    return (f"native kernels: loaded for {info.machine} {isa} (decode attention, norms, rotary, dequantization"
            f"{', panel GEMM' if isa == 'AVX-512' else ''}; {prefill}; {fused}), {threads}, from {path}")


def available() -> str | None:
    """None when the kernels load, else the reason they do not."""
    try:
        library.load()
    except (build.NativeKernelsUnavailable, OSError) as exc:
        return str(exc)
    return None


def op(name: str) -> Callable | None:
    """The native kernel for op ``name`` on this CPU now, or None; the panel ops need a CPU with AVX-512, the
    fused quantized matmul AVX2 (fastest with AVX-512 VNNI)."""
    if name in ("pack_panels", "panel_linear") and not library.load().panel_linear_supported():
        return None
    if name in ("ggml_half_pack", "ggml_half_linear") and not half_panels.supported():
        return None
    if name == "half_linear":
        return half_linear.half_linear_op()
    if name in ("w8a8_pack", "w8a8_linear"):
        return int8_gemm.op(name)
    kernel = NATIVE.get(name)
    if name in ("grouped_dequantize", "int4_dequantize"):
        dtype = quant.tile_dtype()
        return kernel if dtype == torch.float32 else quant.TileDequantize(kernel, dtype)
    if kernel is None or name not in ("ggml_quant_matmul", "ggml_dequantize"):
        return kernel
    quant_matmul = quant.quant_matmul_op()
    if name == "ggml_quant_matmul":
        return quant_matmul
    dtype = quant.tile_dtype()
    if quant_matmul is None and dtype == torch.float32:
        return kernel
    return quant.GGMLDequantize(kernel, quant_matmul, dtype)


# op name -> its native wrapper (op() then picks the variant for this CPU and the settings), and its C file in csrc/
NATIVE = {
    "rms_norm": layer_ops.rms_norm,  # norm.c
    "silu_and_mul": layer_ops.silu_and_mul,  # activation.c
    "gelu_and_mul": layer_ops.gelu_and_mul,  # activation.c
    "rotary_neox": layer_ops.rotary_neox,  # rotary.c
    "ggml_dequantize": quant.ggml_dequantize,  # dequant.c
    "grouped_dequantize": quant.grouped_dequantize,  # dequant.c
    "int4_dequantize": quant.int4_dequantize,  # dequant.c
    "ggml_quant_matmul": quant.ggml_quant_matmul,  # quant_dot.c, amx_quant.c
    "half_linear": half_linear.half_linear,  # half_linear.c, amx_half.c
    "pack_panels": panels.pack_panels,  # panel_linear.c
    "panel_linear": panels.panel_linear,  # panel_linear.c
    "ggml_half_pack": half_panels.pack,  # half_panel.c
    "ggml_half_linear": half_panels.half_panel_linear,  # half_panel.c
    "w8a8_pack": int8_gemm.w8a8_pack,  # int8_gemm.c (a library of its own)
    "w8a8_linear": int8_gemm.w8a8_linear,  # int8_gemm.c
}
# paged_decode_attention (attention.c), paged_prefill_attention (prefill_attention.c) and a quantized KV cache's
# write and attention (kv_quant_attention.c) are called by the backend's own paged_attention (backend.py), not
# looked up.
