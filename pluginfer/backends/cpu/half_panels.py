"""The 16-bit panel GEMM (``csrc/half_panel.c``, AVX-512 or AVX2): a GGUF file's F16/BF16 weights in a float32
model packed once at load into groups of 48 outputs (ops ``ggml_half_pack`` and ``ggml_half_linear``), float32
activations.
Where the CPU has AMX-BF16 the weights stay as stored, for ``half_linear``'s GEMV and AMX tiles."""

from __future__ import annotations

import logging

import torch

from pluginfer.backends.cpu import amx_half, library
from pluginfer.backends.cpu.library import log_once
from pluginfer.backends.cpu.replay import native

# The weight dtypes of csrc/half_panel.c, by its code.
DTYPES = {torch.bfloat16: 0, torch.float16: 1}


def supported() -> bool:
    """Whether this CPU runs the kernel (AVX-512F, or AVX2 with FMA and F16C)."""
    return bool(library.load().half_panel_supported())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """Op ``ggml_half_pack``: the weight in panels (:func:`pack_half_panels`), or None where this CPU's AMX
    bfloat16 tiles take float32 activations against the weight as stored, or for a weight it does not take."""
    if weight.dtype not in DTYPES or weight.device.type != "cpu" or weight.dim() != 2 or 0 in weight.shape:
        return None
    if amx_half.library() is not None:
        return None
    log_once(logging.INFO, "F16/BF16 weights of a float32 model: packed at load into 16-bit panels for the panel "
                            "GEMM (no AMX)")
    return pack_half_panels(weight)


def pack_half_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` bfloat16/float16 CPU weight -> groups of 48 outputs, ``[padded out / 48, in, 48]`` of the same
    values (zero rows padding ``out`` to a multiple of 48)."""
    if weight.dtype not in DTYPES or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_half_panels needs a 2-d bfloat16/float16 CPU weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    out_features, in_features = weight.shape
    weight = weight.contiguous()
    padded = library.load().half_panel_padded_outputs(out_features)
    packed = torch.empty(padded // 48, in_features, 48, dtype=weight.dtype)
    native().pack_half_panels(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
    return packed


def half_panel_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` over any leading dims of float32 ``x``, W packed by :func:`pack_half_panels`; float32 out,
    each weight widened exactly (the float32 ``x @ W.float().T`` up to the order of the sum)."""
    in_features = packed.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != in_features or packed.dtype not in DTYPES:
        raise ValueError(f"half_panel_linear needs float32 inputs of {in_features} features against 16-bit panels, "
                         f"got {x.dtype} {tuple(x.shape)} against {packed.dtype}")
    rows = x.numel() // in_features
    flat = x.reshape(rows, in_features).contiguous()
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    if rows and native().half_panel_linear(DTYPES[packed.dtype], flat.data_ptr(), packed.data_ptr(),
                                         bias.data_ptr() if bias is not None else None, out.data_ptr(), rows,
                                         out_features, in_features):
        raise MemoryError("half_panel_linear could not allocate its row buffer")
    return out
