"""Native CPU kernels for the cpu backend: whether they load, a report line, and the layer ops by name.

The library is C compiled on first use with the system compiler (``native_build``) and loaded through ctypes
(``native_library``); the wrappers live with their kernel family (``native_layer_ops``, ``native_panels``,
``native_quant``, ``native_half_linear``) and step recording in ``native_replay``. When no library can be had
(or ``PLUGINFER_NATIVE=0``) the cpu backend keeps its torch path and logs once why, and how to get them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pluginfer.backends import (
    native_build,
    native_half_linear,
    native_layer_ops,
    native_library,
    native_panels,
    native_quant,
)

# What a log line about missing kernels tells the user to do.
HOW_TO_GET = "install a C compiler (gcc or clang; CC picks one) and restart; PLUGINFER_NATIVE=0 silences this"


def report() -> str:
    """One line for `pluginfer plugins`: which kernels loaded, for which instruction set, or why not."""
    reason = available()
    if reason is not None:
        return f"native kernels: not loaded ({reason}); torch path"
    library, info = native_library.load(), native_library._loaded["info"]
    isa = "AVX-512" if library.panel_linear_supported() else info.machine
    fused_isa = native_quant.QUANT_DOT_ISAS.get(library.quant_dot_supported())
    fused = f"int8 GGML matmul ({fused_isa})" if fused_isa else "no fused int8 GGML matmul"
    half_isa = native_half_linear.HALF_LINEAR_ISAS.get(library.half_linear_supported())
    fused += f"; 16-bit GEMV ({half_isa})" if half_isa else "; no 16-bit GEMV"
    mode, source = native_quant.quant_activations()
    fused += f"; GGUF linears take {mode} activations ({source}; --quant-activations int8 or float)"
    threads = "OpenMP" if info.openmp else "single-threaded (no OpenMP)"
    path = native_library._loaded["path"]
    return (f"native kernels: loaded for {info.machine} {isa} (attention, norms, rotary, dequantization"
            f"{', panel GEMM' if isa == 'AVX-512' else ''}; {fused}), {threads}, from {path}")


def available() -> str | None:
    """None when the kernels load, else the reason they do not."""
    try:
        native_library.load()
    except (native_build.NativeKernelsUnavailable, OSError) as exc:
        return str(exc)
    return None


def op(name: str) -> Callable | None:
    """The kernel for a layer op, or None; the panel ops need a CPU with AVX-512, the fused quantized
    matmul AVX2 (fastest with AVX-512 VNNI)."""
    if name in ("pack_panels", "panel_linear") and not native_library.load().panel_linear_supported():
        return None
    if name == "half_linear":
        return native_half_linear.half_linear_op()
    kernel = OPS.get(name)
    if name in ("grouped_dequantize", "int4_dequantize"):
        dtype = native_quant.tile_dtype()
        return kernel if dtype == torch.float32 else native_quant.TileDequantize(kernel, dtype)
    if kernel is None or name not in ("ggml_quant_matmul", "ggml_dequantize"):
        return kernel
    quant_matmul = native_quant.quant_matmul_op()
    if name == "ggml_quant_matmul":
        return quant_matmul
    dtype = native_quant.tile_dtype()
    if quant_matmul is None and dtype == torch.float32:
        return kernel
    return native_quant.GGMLDequantize(kernel, quant_matmul, dtype)


OPS = {"rms_norm": native_layer_ops.rms_norm, "silu_and_mul": native_layer_ops.silu_and_mul,
       "gelu_and_mul": native_layer_ops.gelu_and_mul,
       "rotary_neox": native_layer_ops.rotary_neox, "ggml_dequantize": native_quant.ggml_dequantize,
       "grouped_dequantize": native_quant.grouped_dequantize, "int4_dequantize": native_quant.int4_dequantize,
       "pack_panels": native_panels.pack_panels, "panel_linear": native_panels.panel_linear,
       "ggml_quant_matmul": native_quant.ggml_quant_matmul, "half_linear": native_half_linear.half_linear}
