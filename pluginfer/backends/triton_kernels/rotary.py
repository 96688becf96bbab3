"""Rotary embedding in place over q and k, neox (halves) or interleaved (adjacent pairs), partial:
ops ``rotary_neox`` and ``rotary_interleaved``. One program per (token, head); float32 arithmetic."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_d, stride_c, half,
                   NEOX: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < half
    cos = tl.load(cos_ptr + token * stride_c + i, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_c + i, mask=mask, other=0.0)
    if NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    base = x_ptr + token * stride_t + head * stride_h
    x1_in = tl.load(base + first * stride_d, mask=mask, other=0.0)
    x1 = x1_in.to(tl.float32)
    x2 = tl.load(base + second * stride_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + first * stride_d, (x1 * cos - x2 * sin).to(x1_in.dtype), mask=mask)
    tl.store(base + second * stride_d, (x2 * cos + x1 * sin).to(x1_in.dtype), mask=mask)


def _rotate(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
            neox: bool) -> bool:
    if query.dim() != 3 or key.dim() != 3 or rotary_dim % 2:
        return False
    half = rotary_dim // 2
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    block = triton.next_power_of_2(half)
    for x in (query, key):
        if x.shape[0]:
            _rotary_kernel[(x.shape[0], x.shape[1])](x, cos, sin, x.stride(0), x.stride(1), x.stride(2),
                                                     cos.stride(0), half, NEOX=neox, BLOCK=block)
    return True


def rotary_neox(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary_dim: int) -> bool:
    return _rotate(query, key, cos, sin, rotary_dim, True)


def rotary_interleaved(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary_dim: int) -> bool:
    return _rotate(query, key, cos, sin, rotary_dim, False)
