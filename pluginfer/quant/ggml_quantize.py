"""Quantization into llama.cpp's GGML block types (the layout and dequantization: ``ggml_blocks.py``).

``quantize(weight, qtype, *, name="weight")``: float ``[rows, cols]`` to uint8 ``[rows, row_bytes]``. F32, F16,
BF16 and Q4_0 ... Q8_0 repeat ``gguf.quants.quantize``'s float32 steps, so the bytes are gguf-py's and
llama.cpp's (following C where gguf-py departs from it: signed zeros); Q4_K and Q6_K port llama.cpp's
``quantize_row_q*_K_ref``. The tests compare all with bytes the C library produced. The K-quants replay C's
sequential sums and trial-scale search, so they are slow: minutes for a large model.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pluginfer.quant.ggml_blocks import T, as_qtype, block_size, row_bytes

QUANTIZE_CHUNK = 1 << 17  # weights quantized together


# --------------------------------------------------------------------------- quantization
# Each function takes float32 blocks [n, block_size] and returns uint8 [n, type_size]. The float
# steps are gguf-py's (legacy types) or llama.cpp's C (K-quants), one for one: float32 division of
# two tensors is IEEE division in torch, but ``scalar / tensor`` is computed as ``scalar *
# (1 / tensor)``, so a scalar numerator is written as a 0-dim tensor (``_divide``).


def _divide(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    return torch.tensor(numerator, dtype=torch.float32, device=denominator.device).div(denominator)


def _f16_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 ``[n]`` or ``[n, 1]`` to ``[n, 2]`` bytes of fp16 (round to nearest even, as ggml)."""
    return values.reshape(-1, 1).to(torch.float16).view(torch.uint8)


def _round_half_away(values: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``, as gguf-py's ``np_roundf`` computes it."""
    magnitude = values.abs()
    floored = torch.floor(magnitude)
    return torch.sign(values) * (floored + torch.floor(2 * (magnitude - floored)))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[n, 2, m]`` values below 16 to ``[n, m]`` bytes: the first half in the low nibbles."""
    return q[:, 0] | (q[:, 1] << 4)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of 32 five-bit values ``[n, 32]`` to a little-endian uint32 mask ``[n, 4]`` bytes."""
    bits = (q >> 4).reshape(-1, 4, 8).long() << torch.arange(8, device=q.device)
    return bits.sum(dim=2).to(torch.uint8)


def _absmax_signed(blocks: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each block ``[n, 1]``, with its sign: the first of equals,
    and +0 for an all-zero block (C starts from ``max = 0`` and takes ``|v| > amax`` only)."""
    absolute = blocks.abs()
    found = blocks.gather(1, absolute.argmax(dim=1, keepdim=True))
    return torch.where(found == 0, 0.0, found)


def _first_equal(blocks: torch.Tensor, extreme: torch.Tensor) -> torch.Tensor:
    """The first element of each block equal to ``extreme`` ``[n, 1]``: C's ``if (v < min) min = v``
    keeps the first of -0 and +0, which torch's ``amin``/``amax`` may not."""
    return blocks.gather(1, (blocks == extreme).to(torch.uint8).argmax(dim=1, keepdim=True))


def _min_max(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    return _first_equal(blocks, low), _first_equal(blocks, high)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _quantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _absmax_signed(blocks) / -8
    q = torch.trunc(blocks * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q.reshape(-1, 2, 16))], dim=1)


def _quantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    low, high = _min_max(blocks)
    d = (high - low) / 15
    q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(low), _pack_nibbles(q.reshape(-1, 2, 16))], dim=1)


def _quantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _absmax_signed(blocks) / -16
    q = torch.trunc(blocks * _inverse(d) + 16.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q.reshape(-1, 2, 16) & 0x0F)], dim=1)


def _quantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    low, high = _min_max(blocks)
    d = (high - low) / 31
    q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(low), _pack_high_bits(q),
                      _pack_nibbles(q.reshape(-1, 2, 16) & 0x0F)], dim=1)


def _quantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = _round_half_away(blocks * _inverse(d)).to(torch.int8)
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1)


def _running_sum(terms: torch.Tensor, from_first: bool = False) -> torch.Tensor:
    """``[m, ...]`` summed over dim 0 left to right in float32, as C's ``for`` loop does (torch's own
    sums are pairwise). From 0, or with ``from_first`` from the first term (``float s = t[0]``)."""
    total = terms[0].clone() if from_first else torch.zeros_like(terms[0]) + terms[0]
    for term in terms[1:]:
        total += term
    return total


def _sqrt(values: torch.Tensor) -> torch.Tensor:
    """C's correctly rounded ``sqrtf``: torch's float32 ``sqrt`` goes through MKL, whose result is
    off by an ulp for some inputs, and for which inputs depends on the CPU."""
    return torch.from_numpy(np.sqrt(values.cpu().numpy())).to(values.device)


def _nearest_int(values: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int`` (adding 1.5 * 2^23 rounds half to even), as float."""
    return torch.round(values)


# The K-quant searches below take sub-blocks as columns, ``x`` ``[m, n]``: weight i of every
# sub-block is one contiguous row, so C's loops over i are sums of rows.


def _make_qkx2_quants(x: torch.Tensor, weights: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants(32, 15, x, weights, L, &the_min, Laux, -1.f, 0.1f, 20, false)`` for each
    column of ``x`` ``[32, n]``: (scale ``[n]``, the_min ``[n]``, levels ``[32, n]`` in 0..15 as float)."""
    nmax = 15
    low = torch.where(x.amin(dim=0) > 0, 0.0, x.amin(dim=0))
    high = x.amax(dim=0)
    flat = high == low  # C returns scale 0, levels 0 for these
    sum_w = _running_sum(weights, from_first=True)
    sum_x = _running_sum(weights * x, from_first=True)
    iscale = _divide(nmax, high - low)
    scale = 1 / iscale
    def weighted_error(scale: torch.Tensor, levels: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        # C: diff = scale * L[i] + min - x[i]; error += w * (diff * diff), step by step in place.
        return _running_sum((levels * scale).add_(low).sub_(x).square_().mul_(weights))

    levels = _nearest_int(iscale * (x - low)).clamp_(0, nmax)
    best_error = weighted_error(scale, levels, low)
    terms = torch.empty(x.shape[0], 3, x.shape[1], dtype=x.dtype, device=x.device)  # w*l, w*l*l, w*l*x
    for step in range(21):
        # (rmin + rdelta * is + nmax) in float32, as C evaluates it; C's min moves with each better
        # step, and later steps measure from it.
        numerator = float(np.float32(-1.0) + np.float32(0.1) * np.float32(step) + np.float32(nmax))
        trial = _nearest_int((x - low).mul_(_divide(numerator, high - low))).clamp_(0, nmax)
        torch.mul(weights, trial, out=terms[:, 0])
        torch.mul(terms[:, 0], trial, out=terms[:, 1])
        torch.mul(terms[:, 0], x, out=terms[:, 2])
        sum_l, sum_l2, sum_xl = _running_sum(terms)
        det = sum_w * sum_l2 - sum_l * sum_l
        trial_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        trial_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clipped = trial_min > 0
        trial_min = torch.where(clipped, 0.0, trial_min)
        trial_scale = torch.where(clipped, sum_xl / sum_l2, trial_scale)
        error = weighted_error(trial_scale, trial, trial_min)
        better = (det > 0) & (error < best_error)
        levels = torch.where(better, trial, levels)
        best_error = torch.where(better, error, best_error)
        scale = torch.where(better, trial_scale, scale)
        low = torch.where(better, trial_min, low)
    scale = torch.where(flat, 0.0, scale)
    levels = torch.where(flat, 0.0, levels)
    return scale, -low, levels


def _quantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """``quantize_row_q4_K_ref``: 8 sub-blocks of 32, each with a 6-bit scale and min."""
    n = blocks.shape[0]
    x = blocks.reshape(n * 8, 32).t().contiguous()
    av_x = _sqrt(_running_sum(x * x) / 32)
    scales, mins, levels = _make_qkx2_quants(x, av_x + x.abs())
    scales, mins, levels = scales.reshape(n, 8), mins.reshape(n, 8), levels.t().reshape(n, 8, 32)

    max_scale = scales.amax(dim=1)
    max_scale = torch.where(max_scale > 0, max_scale, 0.0)
    max_min = mins.amax(dim=1)
    max_min = torch.where(max_min > 0, max_min, 0.0)
    inv_scale = torch.where(max_scale > 0, _divide(63.0, max_scale), 0.0)
    inv_min = torch.where(max_min > 0, _divide(63.0, max_min), 0.0)
    # uint8_t ls = nearest_int(...): a negative result wraps around before MIN(63, ls).
    ls = (_nearest_int(inv_scale[:, None] * scales).long() & 0xFF).clamp(max=63)
    lm = (_nearest_int(inv_min[:, None] * mins).long() & 0xFF).clamp(max=63)
    packed = torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
                        lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                        (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)], dim=1).to(torch.uint8)
    d = (max_scale / 63).to(torch.float16)
    dmin = (max_min / 63).to(torch.float16)

    d_sub = (d.float()[:, None] * ls.float())[..., None]
    dm_sub = (dmin.float()[:, None] * lm.float())[..., None]
    requantized = _nearest_int((blocks.reshape(n, 8, 32) + dm_sub) / d_sub).clamp(0, 15)
    levels = torch.where(d_sub != 0, requantized, levels).to(torch.uint8)  # C skips a sub-block with d == 0
    qs = _pack_nibbles(levels.reshape(n * 4, 2, 32)).reshape(n, 128)
    return torch.cat([d.view(torch.uint8).reshape(n, 2), dmin.view(torch.uint8).reshape(n, 2), packed, qs], dim=1)


def _make_qx_quants(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants(16, 32, x, L, 1, NULL)`` for each column of ``x`` ``[16, n]``: (scale ``[n]``,
    levels ``[16, n]`` in 0..63 as float)."""
    nmax = 32
    signed_max = x.gather(0, x.abs().argmax(dim=0, keepdim=True))[0]
    tiny = signed_max.abs() < 1e-15  # GROUP_MAX_EPS: C returns scale 0, levels 0
    weights = x * x
    weighted_x = weights * x  # C: sumlx += w * x[i] * l, i.e. (w * x) * l
    terms = torch.empty(x.shape[0], 2, x.shape[1], dtype=x.dtype, device=x.device)  # w*x*l, w*l*l

    def levels_at(iscale: torch.Tensor) -> torch.Tensor:
        return _nearest_int(iscale * x).clamp_(-nmax, nmax - 1)

    def sums(levels: torch.Tensor) -> torch.Tensor:
        torch.mul(weighted_x, levels, out=terms[:, 0])
        torch.mul(weights, levels, out=terms[:, 1]).mul_(levels)
        return _running_sum(terms)

    levels = levels_at(_divide(-nmax, signed_max))
    sum_lx, sum_l2 = sums(levels)
    scale = torch.where(sum_l2 != 0, sum_lx / sum_l2, 0.0)
    best = scale * sum_lx
    for step in [*range(-9, 0), *range(1, 10)]:
        numerator = -float(np.float32(nmax) + np.float32(0.1) * np.float32(step))
        trial = levels_at(_divide(numerator, signed_max))
        sum_lx, sum_l2 = sums(trial)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        levels = torch.where(better, trial, levels)
        scale = torch.where(better, sum_lx / sum_l2, scale)
        best = torch.where(better, scale * sum_lx, best)
    scale = torch.where(tiny, 0.0, scale)
    levels = torch.where(tiny, 0.0, levels + nmax)
    return scale, levels


def _quantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """``quantize_row_q6_K_ref``: 16 sub-blocks of 16, each with an int8 scale."""
    n = blocks.shape[0]
    scales, levels = _make_qx_quants(blocks.reshape(n * 16, 16).t().contiguous())
    scales, levels = scales.reshape(n, 16), levels.t().reshape(n, 16, 16)
    max_scale = _absmax_signed(scales)[:, 0]
    empty = max_scale.abs() < 1e-15  # C writes an all-zero block

    iscale = _divide(-128.0, max_scale)
    d = (1 / iscale).to(torch.float16)
    sub_scales = _nearest_int(iscale[:, None] * scales).clamp(max=127)
    d_sub = (d.float()[:, None] * sub_scales)[..., None]
    requantized = _nearest_int(blocks.reshape(n, 16, 16) / d_sub).clamp(-32, 31) + 32
    levels = torch.where(d_sub != 0, requantized, levels).to(torch.uint8).reshape(n, 2, 4, 32)

    ql = torch.cat([levels[:, :, 0] & 0x0F | (levels[:, :, 2] & 0x0F) << 4,
                    levels[:, :, 1] & 0x0F | (levels[:, :, 3] & 0x0F) << 4], dim=2).reshape(n, 128)
    qh = (levels >> 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)[:, None]
    qh = (qh[:, :, 0] | qh[:, :, 1] | qh[:, :, 2] | qh[:, :, 3]).reshape(n, 64)
    out = torch.cat([ql, qh, sub_scales.to(torch.int8).view(torch.uint8),
                     d.view(torch.uint8).reshape(n, 2)], dim=1)
    return torch.where(empty[:, None], 0, out).to(torch.uint8)


def _quantize_bf16(values: torch.Tensor) -> torch.Tensor:
    """gguf-py's (= ggml's) fp32 to bf16: NaN forced quiet, otherwise round to nearest even."""
    bits = values.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    bits = torch.where(nan, (bits & 0xFFFF0000) | (64 << 16), bits)
    half = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) & 0xFFFF
    return torch.stack([half & 0xFF, half >> 8], dim=-1).to(torch.uint8).reshape(values.shape[0], -1)


_QUANTIZE = {
    T.F32: lambda blocks: blocks.contiguous().view(torch.uint8),
    T.F16: lambda blocks: blocks.to(torch.float16).view(torch.uint8),
    T.BF16: _quantize_bf16,
    T.Q4_0: _quantize_q4_0,
    T.Q4_1: _quantize_q4_1,
    T.Q5_0: _quantize_q5_0,
    T.Q5_1: _quantize_q5_1,
    T.Q8_0: _quantize_q8_0,
    T.Q4_K: _quantize_q4_k,
    T.Q6_K: _quantize_q6_k,
}
QUANTIZABLE = frozenset(_QUANTIZE)


def quantize(weight: torch.Tensor, qtype: GGMLQuantizationType | int, *, name: str = "weight") -> torch.Tensor:
    """float ``[rows, cols]`` to uint8 ``[rows, row_bytes]`` in ggml's block layout."""
    qtype = as_qtype(qtype)
    if qtype not in _QUANTIZE:
        raise ValueError(f"cannot quantize {name!r} to GGML type {qtype.name}; supported: "
                         f"{', '.join(t.name for t in _QUANTIZE)}")
    size = block_size(qtype)
    if weight.dim() != 2 or weight.shape[1] % size:
        raise ValueError(f"{qtype.name} needs the input size of {name!r} to be a multiple of {size}, "
                         f"got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    blocks = weight.float().reshape(-1, size)
    # A chunk of blocks at a time keeps the temporaries of the K-quant searches in cache.
    chunks = blocks.split(max(1, QUANTIZE_CHUNK // size))
    return torch.cat([_QUANTIZE[qtype](chunk) for chunk in chunks]).reshape(rows, row_bytes(qtype, cols))
