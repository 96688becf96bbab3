"""The quantized-matmul ops of the kernel table (``core/kernels.py``): one plain torch reference per weight
format (Marlin, GPTQ/AWQ grouped, int8, GGML Q8_0 / Q4_0 / Q4_K / Q6_K). As for every op, the function's
name, signature and docstring are the contract and its body the oracle a device kernel is tested against.
"""

from __future__ import annotations

import torch


def marlin_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                  zeros: torch.Tensor | None, bias: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """``x @ W (+ bias)`` for a 4-bit weight in the Marlin layout (``quant/marlin_layout.py``); ``x`` ``[..., k]``.

    ``packed``: int32 ``[k / 16, 2n]``; ``scales``: permuted ``[groups, n]``; ``zeros``: AWQ zero points
    ``[groups, n / 8]`` in the Marlin order, None for symmetric (zero 8); ``positions``: int32 ``[1024]``,
    where the code of tile row ``r``, run column ``c`` sits in its run (``marlin_layout.position_table``).
    Each weight is dequantized in float32, rounded to ``x``'s dtype, and products summed in float32.
    """
    size_k, size_n = packed.shape[0] * 16, packed.shape[1] // 2
    grouped = group_size != -1 and group_size < size_k
    k = torch.arange(size_k, device=x.device)[:, None]
    n = torch.arange(size_n, device=x.device)[None, :]
    run, column = n // 64, n % 64
    position = positions.long()[(k % 16) * 64 + column]
    word = packed.long()[k // 16, run * 128 + position // 8]
    code = (word >> ((position % 8) * 4)) & 0xF
    if grouped:
        scale_column = run * 64 + 8 * (column % 8) + column // 8
    else:
        c32 = n % 32
        scale_column = (n // 32) * 32 + 8 * ((c32 % 8) // 2) + 2 * (c32 // 8) + c32 % 2
    group = k // (group_size if grouped else size_k)
    scale = scales.float()[group, scale_column]
    zero = 8
    if zeros is not None:
        p = 8 * (column % 8) + column // 8
        slot = run * 64 + (p // 8) * 8 + (p % 2) * 4 + (p % 8) // 2
        zero = (zeros.long()[group, slot // 8] >> ((slot % 8) * 4)) & 0xF
    weight = ((code - zero).float() * scale).to(x.dtype)
    out = (x.reshape(-1, size_k).float() @ weight.float()).to(x.dtype)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], size_n)



def grouped_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor | None, bits: int, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for GPTQ's packing (AWQ repacked into it): ``x`` ``[..., k]``, ``bits`` 4 or 8.

    ``qweight`` int32 ``[k * bits / 32, n]`` (packed along the inputs, lowest bits first); ``qzeros`` int32
    ``[groups, n * bits / 32]`` (the real zero points, packed along the outputs); ``scales`` ``[groups, n]``;
    ``g_idx`` int32 ``[k]``: each input's group (act-order), None for ``k // group_size``.
    ``W[o, i] = (q[i, o] - zero[g, o]) * scale[g, o]`` in float32, rounded to ``x``'s dtype, products
    summed in float32.
    """
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, device=x.device, dtype=torch.int32)
    codes = ((qweight[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, qweight.shape[1])  # [k, n]
    zeros = ((qzeros[:, :, None] >> shifts[None, None, :]) & mask).reshape(qzeros.shape[0], -1)[:, :scales.shape[1]]
    groups = g_idx.long() if g_idx is not None else torch.arange(codes.shape[0], device=x.device) // group_size
    weight = ((codes - zeros[groups]).float() * scales.float()[groups]).to(x.dtype)  # [k, n]
    out = (x.reshape(-1, codes.shape[0]).float() @ weight.float()).to(x.dtype)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], -1)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for per-output-row int8 (W8A16, ``quant/int8.py``): ``qweight`` int8 ``[n, k]``,
    ``weight_scale`` float32 ``[n]``. The int8 products are summed in float32 and rounded to ``x``'s dtype,
    then scaled (in float32) and rounded again, as the layer's torch path."""
    out = (x.float() @ qweight.float().t()).to(x.dtype)
    out = (out * weight_scale).to(x.dtype)
    return out if bias is None else out + bias


def _ggml_matmul(x: torch.Tensor, blocks: torch.Tensor, levels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``blocks`` uint8 ``[n, blocks, bytes]`` (an fp16 scale first), ``levels`` float32 ``[n, blocks, 32]``."""
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    weight = (levels * scale).reshape(blocks.shape[0], -1).to(x.dtype)
    out = (x.float() @ weight.float().t()).to(x.dtype)
    return out if bias is None else out + bias


def ggml_q8_0_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for W in llama.cpp's Q8_0 blocks: ``raw`` uint8 ``[n, cols / 32 * 34]``, each block
    an fp16 scale then 32 int8 levels. Weights dequantized in float32, rounded to ``x``'s dtype, products
    summed in float32."""
    blocks = raw.reshape(raw.shape[0], cols // 32, 34)
    return _ggml_matmul(x, blocks, blocks[..., 2:].contiguous().view(torch.int8).float(), bias)


def ggml_q4_0_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    """As :func:`ggml_q8_0_matmul` for Q4_0 blocks (``[n, cols / 32 * 18]``: an fp16 scale, then 16 bytes
    whose low nibbles are weights 0-15 and high nibbles 16-31, each ``(nibble - 8) * scale``)."""
    blocks = raw.reshape(raw.shape[0], cols // 32, 18)
    nibbles = torch.cat([blocks[..., 2:] & 0x0F, blocks[..., 2:] >> 4], dim=-1)
    return _ggml_matmul(x, blocks, nibbles.float() - 8, bias)


def _f16_at(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Each super-block's fp16 at bytes ``start:start + 2``, as float32 ``[n, blocks, 1]``."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _ggml_k_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    weight = weight.reshape(weight.shape[0], -1).to(x.dtype)
    out = (x.float() @ weight.float().t()).to(x.dtype)
    return out if bias is None else out + bias


def ggml_q4_k_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    """As :func:`ggml_q8_0_matmul` for Q4_K super-blocks (``[n, cols / 256 * 144]``): fp16 ``d`` and ``dmin``,
    12 bytes packing eight 6-bit scales and mins (llama.cpp's ``get_scale_min_k4``), then 128 bytes whose
    32-byte chunk ``c`` holds group ``2c`` in its low nibbles and ``2c + 1`` in its high ones; each weight
    ``q * (d * scale) - dmin * min`` of its group of 32."""
    blocks = raw.reshape(raw.shape[0], cols // 256, 144)
    d, dmin, packed = _f16_at(blocks, 0), _f16_at(blocks, 2), blocks[..., 4:16]
    low_scale, low_min, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low_scale & 0x3F, (high & 0x0F) | ((low_scale >> 2) & 0x30)], dim=-1)
    mins = torch.cat([low_min & 0x3F, (high >> 4) | ((low_min >> 2) & 0x30)], dim=-1)
    chunks = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 1, 32)
    levels = torch.cat([chunks & 0x0F, chunks >> 4], dim=-2).reshape(*blocks.shape[:2], 8, 32).float()
    weight = levels * (d * scales.float()).unsqueeze(-1) - (dmin * mins.float()).unsqueeze(-1)
    return _ggml_k_matmul(x, weight, bias)


def ggml_q6_k_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    """As :func:`ggml_q8_0_matmul` for Q6_K super-blocks (``[n, cols / 256 * 210]``): 128 bytes of low nibbles,
    64 of 2-bit high parts, 16 int8 scales (one per 16 weights), fp16 ``d``. Each half of 128 weights takes
    64 ``ql`` bytes (low nibbles: weights 0-63, high nibbles: 64-127) and 32 ``qh`` bytes (bits ``2r`` for
    weights ``32r`` to ``32r + 31``); each weight ``(q - 32) * (d * scale)``."""
    blocks = raw.reshape(raw.shape[0], cols // 256, 210)
    shape = blocks.shape[:2]
    ql = blocks[..., :128].reshape(*shape, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(*shape, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(*shape, 2, 1, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=raw.device).reshape(4, 1)
    high = (qh >> shifts) & 0x03  # [.., 2, 4, 32]
    levels = ((low | (high << 4)).float() - 32).reshape(*shape, 16, 16)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    weight = levels * (_f16_at(blocks, 208) * scales).unsqueeze(-1)
    return _ggml_k_matmul(x, weight, bias)
