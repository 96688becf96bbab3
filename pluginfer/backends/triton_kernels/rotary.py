"""Rotary embedding in place over q and k, neox (halves) or interleaved (adjacent pairs), partial:
ops ``rotary_neox`` and ``rotary_interleaved``. One program per token, every head of it in one 2-D block
(a program per (token, head) would be too little work each); float32 arithmetic."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_d, stride_c, heads, half,
                   NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK)
    mask = (h[:, None] < heads) & (i[None, :] < half)
    cos = tl.load(cos_ptr + token * stride_c + i, mask=i < half, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * stride_c + i, mask=i < half, other=0.0)[None, :]
    if NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    base = x_ptr + token * stride_t + h[:, None] * stride_h
    x1_in = tl.load(base + first[None, :] * stride_d, mask=mask, other=0.0)
    x1 = x1_in.to(tl.float32)
    x2 = tl.load(base + second[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + first[None, :] * stride_d, (x1 * cos - x2 * sin).to(x1_in.dtype), mask=mask)
    tl.store(base + second[None, :] * stride_d, (x2 * cos + x1 * sin).to(x1_in.dtype), mask=mask)


def _rotate(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
            neox: bool) -> bool:
    if query.dim() != 3 or key.dim() != 3 or rotary_dim % 2:
        return False
    half = rotary_dim // 2
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    block = triton.next_power_of_2(half)
    for x in (query, key):
        if x.shape[0]:
            _rotary_kernel[(x.shape[0],)](x, cos, sin, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
                                          x.shape[1], half, NEOX=neox, BLOCK_H=triton.next_power_of_2(x.shape[1]),
                                          BLOCK=block)
    return True


def rotary_neox(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary_dim: int) -> bool:
    return _rotate(query, key, cos, sin, rotary_dim, True)


def rotary_interleaved(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary_dim: int) -> bool:
    return _rotate(query, key, cos, sin, rotary_dim, False)
