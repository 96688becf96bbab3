"""This format's kernel op: defined here (its torch reference is the contract), with a cpu kernel of its own.

Imported by ``method.py`` when the method is selected, so the op exists before any layer asks for it.
"""

from __future__ import annotations

import torch

from pluginfer.core import kernels

# output rows converted at a time: one small float tile, never the layer's whole weight
TILE_ROWS = 512


@kernels.define_op
def example_int8_rowwise_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` where ``W = qweight * scale[:, None]``: ``qweight`` int8 ``[n, k]``, ``scale`` float32
    ``[n]``, ``x`` ``[..., k]`` float. Dequantizes in float32, multiplies in float32, returns ``x``'s dtype."""
    weight = qweight.float() * scale.float()[:, None]
    out = (x.float() @ weight.t()).to(x.dtype)
    return out if bias is None else out + bias


def int8_rowwise_matmul_cpu(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
    """The cpu kernel: the int8 codes (exact in every float dtype) multiply ``x`` in its own dtype, a tile of
    rows at a time, and the scale is applied to the output columns, so no dequantized weight is ever made."""
    flat = x.reshape(-1, x.shape[-1])
    rows = qweight.shape[0]
    out = torch.empty(flat.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, TILE_ROWS):
        stop = min(start + TILE_ROWS, rows)
        torch.matmul(flat, qweight[start:stop].to(x.dtype).t(), out=out[:, start:stop])
    out.mul_(scale)  # in float32, rounded once to x.dtype
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], rows)


kernels.implement("cpu", "example_int8_rowwise_matmul", int8_rowwise_matmul_cpu)
