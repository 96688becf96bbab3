"""``x @ W^T`` read straight from llama.cpp's Q8_0 and Q4_0 blocks (ops ``ggml_q8_0_matmul``, ``ggml_q4_0_matmul``).

A k-step of the kernel is one GGML block of 32 inputs: for each of its ``BLOCK_N`` output rows it reads
the block's fp16 scale (two bytes, assembled and bit-cast) and the 32 levels (Q8_0: int8 bytes; Q4_0:
16 bytes, low nibbles first, minus 8), dequantizes in float32, rounds to ``x``'s dtype and accumulates
in float32. No float copy of W is made. References: ``quant.ggml_ops.ggml_q8_0_matmul`` / ``ggml_q4_0_matmul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.backends.triton_kernels import dot_in_float32

_BLOCK = 32  # weights per GGML block


@triton.jit
def _ggml_matmul_kernel(
    x_ptr, raw_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_rn, stride_om,
    Q4: tl.constexpr, BLOCK_BYTES: tl.constexpr, WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 32)  # the weight within its block
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = raw_ptr + offs_n.to(tl.int64) * stride_rn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(0, K // 32):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (block * 32 + offs_j)[None, :] * stride_xk,
                    mask=mask_m[:, None], other=0.0)
        base = rows + block * BLOCK_BYTES
        low = tl.load(base, mask=mask_n, other=0).to(tl.uint16)
        high = tl.load(base + 1, mask=mask_n, other=0).to(tl.uint16)
        scale = (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)  # [BLOCK_N]
        if Q4:
            byte = tl.load(base[None, :] + 2 + (offs_j % 16)[:, None], mask=mask_n[None, :], other=0)
            nibble = tl.where(offs_j[:, None] < 16, byte & 0x0F, byte >> 4)
            level = nibble.to(tl.float32) - 8.0
        else:
            level = tl.load(base[None, :] + 2 + offs_j[:, None], mask=mask_n[None, :], other=0)
            level = level.to(tl.int8, bitcast=True).to(tl.float32)
        weight = (level * scale[None, :]).to(x.dtype)  # [32, BLOCK_N]
        if WIDEN:
            acc = tl.dot(x.to(tl.float32), weight.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, weight, acc)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _ggml_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None, q4: bool) -> torch.Tensor:
    block_bytes = 18 if q4 else 34
    if x.shape[-1] != cols or cols % _BLOCK or raw.shape[-1] != cols // _BLOCK * block_bytes or raw.dtype != torch.uint8:
        raise ValueError(f"ggml_{'q4_0' if q4 else 'q8_0'}_matmul: x has {x.shape[-1]} features; the weight {cols} "
                         f"in uint8 rows of {cols // _BLOCK * block_bytes} bytes, got {raw.dtype} {tuple(raw.shape)}")
    flat = x.reshape(-1, cols)
    size_n = raw.shape[0]
    out = torch.empty(flat.shape[0], size_n, dtype=x.dtype, device=x.device)
    block_m = 16 if flat.shape[0] <= 16 else 32 if flat.shape[0] <= 32 else 64
    grid = (triton.cdiv(flat.shape[0], block_m), triton.cdiv(size_n, 64))
    _ggml_matmul_kernel[grid](
        flat, raw, out, flat.shape[0], size_n, cols, flat.stride(0), flat.stride(1), raw.stride(0), out.stride(0),
        Q4=q4, BLOCK_BYTES=block_bytes, WIDEN=dot_in_float32(x.dtype), BLOCK_M=block_m, BLOCK_N=64,
    )
    out = out.reshape(*x.shape[:-1], size_n)
    return out if bias is None else out + bias


def ggml_q8_0_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    return _ggml_matmul(x, raw, cols, bias, q4=False)


def ggml_q4_0_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    return _ggml_matmul(x, raw, cols, bias, q4=True)
