"""W8A8 (ops ``w8a8_pack`` and ``w8a8_linear``, the ``compressed-tensors`` method's): each activation row quantized
once per call by one program (``scale = max|x| / 127.5``, round half to even, levels clamped to ``[-128, 127]``),
then int8 tiles multiplied with int32 accumulation (exact) and ``(acc * x_scale) * weight_scale (+ bias)`` in
float32. The weight keeps the checkpoint's int8 ``[n, k]`` layout. Reference: ``quant.compressed_tensors``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 to an integer, half to even
_ROUND = 12582912.0


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.max(amax, axis=0) / 127.5
    divisor = tl.where(scale == 0.0, 1.0, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        level = (tl.math.div_rn(x, divisor) + _ROUND) - _ROUND
        level = tl.minimum(tl.maximum(level, -128.0), 127.0)
        tl.store(q_ptr + row * K + offs, level.to(tl.int8), mask=offs < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def _w8a8_kernel(
    q_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(q, w, acc, out_dtype=tl.int32)
    x_scale = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    w_scale = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    out = (acc.to(tl.float32) * x_scale[:, None]) * w_scale[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def w8a8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """The checkpoint's int8 ``[n, k]``, contiguous: the layout the kernel reads."""
    return qweight.contiguous()


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    size_k = x.shape[-1]
    if packed.shape != (out_features, size_k):
        raise ValueError(f"w8a8_linear: weights {tuple(packed.shape)} are not {out_features} outputs of {size_k} inputs")
    flat = x.reshape(-1, size_k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    levels = torch.empty(rows, size_k, dtype=torch.int8, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](flat, levels, scales, size_k, flat.stride(0), BLOCK_K=256)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, 64))
    bias_arg = bias.contiguous() if bias is not None else scales
    _w8a8_kernel[grid](
        levels, scales, packed, weight_scale.float().contiguous(), bias_arg, out, rows, out_features, size_k,
        packed.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32,
    )
    return out.reshape(*x.shape[:-1], out_features)
