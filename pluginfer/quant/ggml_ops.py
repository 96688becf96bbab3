"""The kernel ops of llama.cpp's GGML blocks, defined at import: the whole-tile dequantization, the fused
int8-activation matmul, one matmul per block type a device kernel reads (Q8_0, Q4_0, Q4_K, Q6_K), and the
packing and matmul of F16/BF16 weights read by float32 activations.

The gguf and in-situ GGML methods ask their backend for these (``DeviceBackend.op``); importing them from
here defines them first. Each reference's body is the oracle of the backends' kernels (the cpu backend's C,
the cuda backend's Triton).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from pluginfer.core.kernels import define_op
from pluginfer.quant.ggml_blocks import dequantize, quantize_activations


@define_op
def ggml_dequantize(raw: torch.Tensor, qtype: int, cols: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Raw GGML blocks uint8 ``[rows, row_bytes]`` of type ``qtype`` (a ``GGMLQuantizationType`` value) to
    float32 ``[rows, cols]`` (into ``out`` when given: a contiguous float32 or bfloat16 tensor of at least
    ``rows * cols`` elements, whose dtype the result takes, each value the float32 one rounded to nearest
    even). None from a kernel: a type or layout it does not take (the caller runs ``ggml_blocks.dequantize``).
    A kernel may carry ``quant_matmul`` (its ``ggml_quant_matmul``) and ``quant_matmul_max_rows``, which
    ``ggml_blocks.ggml_linear`` reads."""
    dense = dequantize(raw, int(qtype), cols)
    if out is None:
        return dense
    return out.view(-1)[:dense.numel()].view(dense.shape).copy_(dense)


@define_op
def ggml_quant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, cols: int) -> torch.Tensor | None:
    """``x @ W^T`` for float ``x [..., cols]`` and ``W`` the raw GGML blocks uint8 ``[rows, row_bytes]``, with
    ``x`` quantized per block of 32 to int8 levels and float32 scales as llama.cpp's Q8_0
    (``ggml_blocks.quantize_activations``): ``(levels * scales) @ W^T`` in float32 up to the order of the sum,
    in ``x``'s dtype. None from a kernel: a type, dtype or layout it does not take."""
    levels, scales = quantize_activations(x)
    activations = (levels.float().unflatten(-1, (-1, 32)) * scales[..., None]).flatten(-2)
    return (activations @ dequantize(raw, int(qtype), cols).t()).to(x.dtype)


def _ggml_matmul(x: torch.Tensor, blocks: torch.Tensor, levels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``blocks`` uint8 ``[n, blocks, bytes]`` (an fp16 scale first), ``levels`` float32 ``[n, blocks, 32]``."""
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    weight = (levels * scale).reshape(blocks.shape[0], -1).to(x.dtype)
    out = (x.float() @ weight.float().t()).to(x.dtype)
    return out if bias is None else out + bias


@define_op
def ggml_q8_0_matmul(x: torch.Tensor, raw: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for W in llama.cpp's Q8_0 blocks: ``raw`` uint8 ``[n, cols / 32 * 34]``, each block
    an fp16 scale then 32 int8 levels. Weights dequantized in float32, rounded to ``x``'s dtype, products
    summed in float32."""
    blocks = raw.reshape(raw.shape[0], cols // 32, 34)
    return _ggml_matmul(x, blocks, blocks[..., 2:].contiguous().view(torch.int8).float(), bias)


@define_op
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


@define_op
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


@define_op
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



@define_op
def ggml_half_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """A GGUF file's F16/BF16 linear weight ``[out, in]``, kept 16-bit for float32 activations, in the layout the
    backend's :func:`ggml_half_linear` reads (a new tensor: the file's mapped bytes are released). The reference
    keeps the checkpoint's layout. None from a kernel: it does not take this weight here (the caller keeps the
    weight as stored, for the ``half_linear`` op or float tiles)."""
    return weight


@define_op
def ggml_half_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` for float32 ``x [..., in]`` and W packed by :func:`ggml_half_pack` of the same backend,
    float32 out: each weight widened exactly, the float32 ``x @ W.float().T`` up to the order of its sum."""
    return torch.nn.functional.linear(x, packed[:out_features].to(x.dtype), bias)


# GGML type -> the op of a device kernel reading its blocks; the other types have none.
MATMUL_OPS = {GGMLQuantizationType.Q8_0: "ggml_q8_0_matmul", GGMLQuantizationType.Q4_0: "ggml_q4_0_matmul",
              GGMLQuantizationType.Q4_K: "ggml_q4_k_matmul", GGMLQuantizationType.Q6_K: "ggml_q6_k_matmul"}
