"""``x @ W^T`` for per-output-row int8 weights (op ``int8_matmul``, W8A16 of ``quant/int8.py``).

Each ``[BLOCK_K, BLOCK_N]`` tile of the int8 ``qweight`` ``[n, k]`` is converted to ``x``'s dtype in
registers (every level up to 127 is exact there) and multiplied with float32 accumulation; the sum is
rounded to ``x``'s dtype, multiplied by the row's float32 scale and rounded again, as the layer's torch
path. Reference: ``quant.int8.int8_matmul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.backends.triton_kernels import dot_in_float32


@triton.jit
def _int8_matmul_kernel(
    x_ptr, q_ptr, s_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_qn, stride_om,
    WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        q = tl.load(q_ptr + offs_n[None, :].to(tl.int64) * stride_qn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0)
        if WIDEN:
            acc = tl.dot(x.to(tl.float32), q.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, q.to(x.dtype), acc)
    scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    out = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * scale[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    size_n, size_k = qweight.shape
    if x.shape[-1] != size_k:
        raise ValueError(f"int8_matmul: x has {x.shape[-1]} features, the weight {size_k}")
    flat = x.reshape(-1, size_k)
    out = torch.empty(flat.shape[0], size_n, dtype=x.dtype, device=x.device)
    block_m = 16 if flat.shape[0] <= 16 else 32 if flat.shape[0] <= 32 else 64
    grid = (triton.cdiv(flat.shape[0], block_m), triton.cdiv(size_n, 64))
    _int8_matmul_kernel[grid](
        flat, qweight, weight_scale.float().contiguous(), out, flat.shape[0], size_n, size_k,
        flat.stride(0), flat.stride(1), qweight.stride(0), out.stride(0),
        WIDEN=dot_in_float32(x.dtype), BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32,
    )
    out = out.reshape(*x.shape[:-1], size_n)
    return out if bias is None else out + bias
