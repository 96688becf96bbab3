"""``x @ W^T`` read straight from GPTQ's packing (op ``grouped_matmul``; AWQ is repacked into it at load).

For each ``[BLOCK_K, BLOCK_N]`` tile the kernel takes every weight's code from its int32 word of
``qweight`` (packed along the inputs), its group from ``g_idx`` (act-order) or ``k // group_size``,
that group's zero point (packed along the outputs) and scale, dequantizes in float32 registers,
rounds to ``x``'s dtype and accumulates ``x @ w`` in float32. 4- and 8-bit. Reference:
``quant.packing.grouped_matmul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.backends.triton_kernels import dot_in_float32


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, q_ptr, z_ptr, s_ptr, g_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qk, stride_zg, stride_sg, stride_om,
    BITS: tl.constexpr, HAS_G_IDX: tl.constexpr, WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    zero_shift = (offs_n % PACK) * BITS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_n[None, :]
        word = tl.load(q_ptr + (offs_k // PACK)[:, None] * stride_qk + offs_n[None, :], mask=mask_w, other=0)
        code = (word >> ((offs_k % PACK) * BITS)[:, None]) & MASK
        if HAS_G_IDX:
            group = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
        else:
            group = offs_k // group_size
        zword = tl.load(z_ptr + group[:, None] * stride_zg + (offs_n // PACK)[None, :], mask=mask_w, other=0)
        zero = (zword >> zero_shift[None, :]) & MASK
        scale = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=mask_w, other=0.0)
        weight = ((code - zero).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
        if WIDEN:
            # float32 (and bf16 under the interpreter): ieee products, no tf32
            acc = tl.dot(x.to(tl.float32), weight.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, weight, acc)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def grouped_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor | None, bits: int, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    if bits not in (4, 8):
        raise ValueError(f"grouped_matmul: {bits}-bit weights (the kernel reads 4 and 8)")
    size_k, size_n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    if x.shape[-1] != size_k:
        raise ValueError(f"grouped_matmul: x has {x.shape[-1]} features, the weight {size_k}")
    flat = x.reshape(-1, size_k)
    out = torch.empty(flat.shape[0], size_n, dtype=x.dtype, device=x.device)
    block_m = 16 if flat.shape[0] <= 16 else 32 if flat.shape[0] <= 32 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(flat.shape[0], block_m), triton.cdiv(size_n, block_n))
    _grouped_matmul_kernel[grid](
        flat, qweight, qzeros, scales, g_idx if g_idx is not None else qweight, out,
        flat.shape[0], size_n, size_k, group_size,
        flat.stride(0), flat.stride(1), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, HAS_G_IDX=g_idx is not None, WIDEN=dot_in_float32(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], size_n)
