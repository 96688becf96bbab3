"""Grouped LoRA matmul (punica's SGMV), op ``lora_sgmv``: each adapter's rows of the batch times its slot's
matrix, every adapter in one launch (a program per group, block of its rows and block of outputs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.backends.triton_kernels import dot_in_float32

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, order_ptr, slots_ptr, starts_ptr, K, N,
                 stride_xm, stride_xk, stride_ws, stride_wk, stride_wn, stride_om, stride_on,
                 WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    group, block_m, block_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + group)
    end = tl.load(starts_ptr + group + 1)
    slot = tl.load(slots_ptr + group).to(tl.int64)
    offs_m = start + block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end  # a block past its group's rows does nothing
    rows = tl.load(order_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + slot * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_base + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if WIDEN:  # float32 or mixed operands (and bf16 under the interpreter, whose bf16 tl.dot is wrong)
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = mask_m[:, None] & mask_n[None, :]
    total = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


def lora_sgmv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, order: torch.Tensor,
              group_slots: torch.Tensor, group_starts: torch.Tensor, max_group_rows: int) -> bool:
    groups = group_slots.shape[0]
    if not groups or not max_group_rows:
        return True
    K, N = weight.shape[1], weight.shape[2]
    widen = dot_in_float32(x.dtype) or x.dtype != weight.dtype
    grid = (groups, triton.cdiv(max_group_rows, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _sgmv_kernel[grid](x, weight, out, order, group_slots, group_starts, K, N,
                       x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
                       out.stride(0), out.stride(1), WIDEN=widen, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return True
