"""``x @ W`` read straight from Marlin tiles (op ``marlin_matmul``): the format is ``quant/marlin_layout.py``.

The kernel never builds ``W``: for each ``[BLOCK_K, BLOCK_N]`` tile it finds every weight's int32
word and nibble in ``B`` through ``positions`` (the inverse of the Marlin permutation, a 16x64 table
the quant method hands over), its scale in the permuted scales (closed form) and, for AWQ, its zero
point, dequantizes in registers and accumulates ``x @ w`` in float32. Its references: the table's
``quant.marlin_layout.marlin_matmul`` and the layout's own ``marlin_layout.matmul_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE, PACK = 16, 8  # Marlin tiles are 16 x 16; eight 4-bit codes per int32 word


@triton.jit
def _marlin_matmul_kernel(
    x_ptr, b_ptr, s_ptr, z_ptr, table_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_bk, stride_sg, stride_zg, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, GROUPED_SCALES: tl.constexpr, HAS_ZEROS: tl.constexpr, IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # 64 output columns per permutation run: 128 words of B per tile row
    run = offs_n // 64
    column = offs_n % 64
    if GROUPED_SCALES:  # position 8i + j of a 64-column run holds column i + 8j
        scale_column = run * 64 + 8 * (column % 8) + column // 8
    else:
        # 32-column runs, order [2i + j for j in (0, 1, 8, 9, 16, 17, 24, 25)]
        c32 = offs_n % 32
        scale_column = (offs_n // 32) * 32 + 8 * ((c32 % 8) // 2) + 2 * (c32 // 8) + c32 % 2
    if HAS_ZEROS:
        # grouped scale order, then the [0, 2, 4, 6, 1, 3, 5, 7] interleave, 8 per word
        p = 8 * (column % 8) + column // 8
        zero_slot = run * 64 + (p // 8) * 8 + (p % 2) * 4 + (p % 8) // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_n[None, :]
        position = tl.load(table_ptr + (offs_k % 16)[:, None] * 64 + column[None, :], mask=mask_w, other=0)
        word = tl.load(b_ptr + (offs_k // 16)[:, None] * stride_bk + run[None, :] * 128 + position // 8,
                       mask=mask_w, other=0)
        code = (word >> ((position % 8) * 4)) & 0xF
        group = offs_k // GROUP_SIZE
        scale = tl.load(s_ptr + group[:, None] * stride_sg + scale_column[None, :], mask=mask_w, other=0.0)
        if HAS_ZEROS:
            zword = tl.load(z_ptr + group[:, None] * stride_zg + (zero_slot // 8)[None, :], mask=mask_w, other=0)
            zero = (zword >> ((zero_slot % 8) * 4)[None, :]) & 0xF
        else:
            zero = 8
        weight = ((code - zero).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
        if IEEE_DOT:  # float32 inputs: no tf32 rounding
            acc = tl.dot(x, weight, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, weight, acc)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def marlin_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                  zeros: torch.Tensor | None, bias: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """``x @ W (+ bias)`` for the Marlin weight ``(packed, scales[, zeros])``; ``x`` is ``[..., k]``.

    ``packed``: ``B`` int32 ``[k / 16, 2n]``; ``scales``: permuted ``[groups, n]``; ``zeros``: AWQ
    zero points in the Marlin layout (``[groups, n / 8]``), None for symmetric GPTQ (zero 8);
    ``positions``: ``marlin_layout.position_table(x.device)``.
    """
    size_k, size_n = packed.shape[0] * TILE, packed.shape[1] * PACK // TILE
    if x.shape[-1] != size_k:
        raise ValueError(f"marlin_matmul: x has {x.shape[-1]} features, the weight {size_k}")
    flat = x.reshape(-1, size_k)
    out = torch.empty(flat.shape[0], size_n, dtype=x.dtype, device=x.device)
    grouped = group_size != -1 and group_size < size_k
    block_m = 16 if flat.shape[0] <= 16 else 32 if flat.shape[0] <= 32 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(flat.shape[0], block_m), triton.cdiv(size_n, block_n))
    _marlin_matmul_kernel[grid](
        flat, packed, scales, zeros if zeros is not None else packed, positions, out,
        flat.shape[0], size_n, size_k,
        flat.stride(0), flat.stride(1), packed.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, out.stride(0), out.stride(1),
        GROUP_SIZE=group_size if grouped else size_k, GROUPED_SCALES=grouped, HAS_ZEROS=zeros is not None,
        IEEE_DOT=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], size_n)
