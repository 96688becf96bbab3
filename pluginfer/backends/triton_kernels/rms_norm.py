"""RMSNorm with the residual add fused in: one program per row (op ``rms_norm`` of ``layers/ops.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps, offset,
                     HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, IS_FP32: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # residual <- x + residual, rounded to its dtype as torch's add is; that sum is normalized
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual.dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    wide = x.to(tl.float32)
    normed = wide * tl.math.rsqrt(tl.sum(wide * wide, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        out = normed * (weight + offset)
    elif IS_FP32:
        out = normed * weight
    else:
        # as layers.norm.RMSNorm: round the normalized row, then multiply by the weight in its dtype
        out = normed.to(x.dtype).to(tl.float32) * weight
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             offset: float) -> torch.Tensor | None:
    cols = x.shape[-1]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        return None
    rows = x.numel() // cols
    flat = x.reshape(rows, cols)
    flat_residual = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
            return None
        flat_residual = residual.view(rows, cols)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    flat_out = out.view(rows, cols)
    _rms_norm_kernel[(rows,)](
        flat, flat_residual if flat_residual is not None else flat, weight, flat_out,
        flat.stride(0), flat_residual.stride(0) if flat_residual is not None else 0, flat_out.stride(0),
        cols, eps, offset,
        HAS_RESIDUAL=flat_residual is not None, HAS_OFFSET=bool(offset), IS_FP32=x.dtype == torch.float32,
        BLOCK=triton.next_power_of_2(cols),
    )
    return out
