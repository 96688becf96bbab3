"""``x @ W^T`` read straight from llama.cpp's Q4_K and Q6_K super-blocks (ops ``ggml_q4_k_matmul``,
``ggml_q6_k_matmul``).

A k-step is one of a 256-weight super-block's eight groups of 32: for each of ``BLOCK_N`` output rows it reads
``d`` (and Q4_K's ``dmin``), the group's scales and its 32 levels, dequantizes in float32 in ``ggml_blocks``'
order, rounds to ``x``'s dtype and accumulates in float32; no float copy of W is made. Q4_K: weight =
``q * (d * scale) - dmin * min``; Q6_K: ``(q - 32) * (d * scale)``. References:
``quant.ggml_ops.ggml_q4_k_matmul`` / ``ggml_q6_k_matmul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.backends.triton_kernels import dot_in_float32

_SUPER = 256  # weights per super-block
_BYTES = {"q4_k": 144, "q6_k": 210}


@triton.jit
def _half(ptr, mask):
    """Two little-endian bytes at ``ptr`` ([BLOCK_N] pointers) as fp16, widened to float32."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _ggml_k_matmul_kernel(
    x_ptr, raw_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_rn, stride_om,
    Q6: tl.constexpr, BLOCK_BYTES: tl.constexpr, WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 32)  # the weight within its group
    mask_m = offs_m < M
    mask_n = offs_n < N
    wmask = mask_n[None, :]
    rows = raw_ptr + offs_n.to(tl.int64) * stride_rn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, K // 32):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (step * 32 + offs_j)[None, :] * stride_xk,
                    mask=mask_m[:, None], other=0.0)
        base = rows + (step // 8) * BLOCK_BYTES  # the super-block, [BLOCK_N]
        g = step % 8
        if Q6:
            h = g // 4
            r = g % 4
            d = _half(base + 208, mask_n)
            low = tl.load(base[None, :] + (h * 64 + (r % 2) * 32) + offs_j[:, None], mask=wmask, other=0)
            low = (low >> (4 * (r // 2))) & 0x0F
            high = tl.load(base[None, :] + (128 + h * 32) + offs_j[:, None], mask=wmask, other=0)
            high = (high >> (2 * r)) & 0x03
            level = (low | (high << 4)).to(tl.float32) - 32.0  # [32, BLOCK_N]
            scale = tl.load(base[None, :] + 192 + g * 2 + offs_j[:, None] // 16, mask=wmask, other=0)
            scale = scale.to(tl.int8, bitcast=True).to(tl.float32)
            weight = level * (d[None, :] * scale)
        else:
            d = _half(base, mask_n)
            dmin = _half(base + 2, mask_n)
            # scales of groups 4-7 take their high bits from groups 0-3's bytes
            gl = g % 4
            sc_byte = tl.load(base + 4 + gl, mask=mask_n, other=0)
            mn_byte = tl.load(base + 8 + gl, mask=mask_n, other=0)
            if g < 4:
                scale = sc_byte & 0x3F
                minimum = mn_byte & 0x3F
            else:
                md_byte = tl.load(base + 12 + gl, mask=mask_n, other=0)
                scale = (md_byte & 0x0F) | ((sc_byte >> 2) & 0x30)
                minimum = (md_byte >> 4) | ((mn_byte >> 2) & 0x30)
            dl = d * scale.to(tl.float32)
            ml = dmin * minimum.to(tl.float32)
            byte = tl.load(base[None, :] + 16 + (g // 2) * 32 + offs_j[:, None], mask=wmask, other=0)
            level = ((byte >> (4 * (g % 2))) & 0x0F).to(tl.float32)
            weight = level * dl[None, :] - ml[None, :]
        weight = weight.to(x.dtype)  # [32, BLOCK_N]
        if WIDEN:
            acc = tl.dot(x.to(tl.float32), weight.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, weight, acc)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _ggml_k_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None,
                   qtype: str) -> torch.Tensor:
    block_bytes = _BYTES[qtype]
    if x.shape[-1] != cols or cols % _SUPER or raw.shape[-1] != cols // _SUPER * block_bytes or raw.dtype != torch.uint8:
        raise ValueError(f"ggml_{qtype}_matmul: x has {x.shape[-1]} features; the weight {cols} (a multiple of "
                         f"{_SUPER}) in uint8 rows of {cols // _SUPER * block_bytes} bytes, got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    flat = x.reshape(-1, cols)
    size_n = raw.shape[0]
    out = torch.empty(flat.shape[0], size_n, dtype=x.dtype, device=x.device)
    block_m = 16 if flat.shape[0] <= 16 else 32 if flat.shape[0] <= 32 else 64
    grid = (triton.cdiv(flat.shape[0], block_m), triton.cdiv(size_n, 64))
    _ggml_k_matmul_kernel[grid](
        flat, raw, out, flat.shape[0], size_n, cols, flat.stride(0), flat.stride(1), raw.stride(0), out.stride(0),
        Q6=qtype == "q6_k", BLOCK_BYTES=block_bytes, WIDEN=dot_in_float32(x.dtype), BLOCK_M=block_m, BLOCK_N=64,
    )
    out = out.reshape(*x.shape[:-1], size_n)
    return out if bias is None else out + bias


def ggml_q4_k_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    return _ggml_k_matmul(x, raw, cols, bias, "q4_k")


def ggml_q6_k_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    return _ggml_k_matmul(x, raw, cols, bias, "q6_k")
