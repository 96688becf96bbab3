"""The float32 panel GEMM (``csrc/panel_linear.c``, AVX-512): weights packed once into panels of 16 outputs."""

from __future__ import annotations

import torch

from pluginfer.backends.cpu import library
from pluginfer.backends.cpu.replay import native


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` float32 CPU weight -> panels of 16 outputs (``[padded out / 16, in, 16]``, zero
    rows padding ``out`` to a multiple of 64; ``csrc/panel_linear.c``)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_panels needs a 2-d float32 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    out_features, in_features = weight.shape
    weight = weight.contiguous()
    padded = library.load().panel_padded_outputs(out_features)
    packed = torch.empty(padded // 16, in_features, 16, dtype=torch.float32)
    native().pack_panels(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
    return packed


def panel_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` over any leading dims of float32 ``x``, W packed by :func:`pack_panels`."""
    in_features = packed.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != in_features:
        raise ValueError(f"panel_linear needs float32 inputs of {in_features} features, got {x.dtype} "
                         f"{tuple(x.shape)}")
    rows = x.numel() // in_features
    flat = x.reshape(rows, in_features).contiguous()
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    if rows and native().panel_linear(flat.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                                    out.data_ptr(), rows, out_features, in_features):
        raise MemoryError("panel_linear could not allocate its row buffer")
    return out
