"""Quantized KV cache rows in Triton (the layout is ``layers/kv_quant.py``'s): codes widened to float32 and float32
quantized to codes by integer bit arithmetic, the same on a GPU and under ``TRITON_INTERPRET=1`` (numpy has no
float8). The kernels read a cache as bytes and its scales through a float32 view of the same memory.

KIND: 0 a float cache, 1 int8, 2 float8 E4M3, 3 float8 E5M2. E4M3 codes widen to value * 2^-8 (their bits
shifted into a half's place): :func:`wide_factor` folds the 2^8 into the row's scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.layers import kv_quant

KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def kind(cache: torch.Tensor) -> int:
    return KINDS.get(cache.dtype, 0)


def views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the cache as bytes, or itself when float; its scales ``[blocks, block_size, heads]`` float32, or the cache
    itself when float; the features per row)."""
    if not kv_quant.is_quantized(cache.dtype):
        return cache, cache, cache.shape[-1]
    dim = kv_quant.feature_dim(cache)
    data = cache.view(torch.uint8)
    return data, data.view(torch.float32)[..., dim // 4], dim


def scale_strides(scales: torch.Tensor) -> tuple[int, int, int]:
    return scales.stride()[:3]


@triton.jit
def wide_factor(KIND: tl.constexpr):
    if KIND == 2:
        return 256.0
    return 1.0


@triton.jit
def widen(codes, KIND: tl.constexpr):
    """uint8 codes as float32 (E4M3: value * 2^-8)."""
    if KIND == 1:
        return codes.to(tl.int8, bitcast=True).to(tl.float32)
    c = codes.to(tl.uint16)
    if KIND == 2:
        bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    else:
        bits = c << 8
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _round_even(x):
    """x rounded to the nearest integer, ties to even (as C's nearbyintf and torch.round)."""
    floor = tl.floor(x)
    rest = x - floor
    odd = (floor - 2.0 * tl.floor(floor * 0.5)) == 1.0
    return tl.where((rest > 0.5) | ((rest == 0.5) & odd), floor + 1.0, floor)


@triton.jit
def _fp8(y, MBITS: tl.constexpr, BIAS: tl.constexpr, SUBNORMAL_STEPS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """float8 code of y (within the format's range), rounded to nearest even."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    bits = bits & 0x7FFFFFFF
    magnitude = bits.to(tl.float32, bitcast=True)
    # below the smallest normal: SUBNORMAL_STEPS per unit; 2^MBITS steps is the smallest normal's code
    subnormal = _round_even(magnitude * SUBNORMAL_STEPS).to(tl.uint32)
    shift: tl.constexpr = 23 - MBITS
    rounded = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)
    normal = ((((rounded >> 23) - 127 + BIAS) << MBITS) | ((rounded >> shift) & ((1 << MBITS) - 1)))
    code = tl.where(magnitude < MIN_NORMAL, subnormal, normal)
    return (sign | code).to(tl.uint8)


@triton.jit
def encode(y, KIND: tl.constexpr):
    """Codes (uint8) of y = x / scale, already clamped to the format's range."""
    if KIND == 1:
        return _round_even(y).to(tl.int8).to(tl.uint8, bitcast=True)
    if KIND == 2:
        return _fp8(y, 3, 7, 512.0, 0.015625)  # steps of 2^-9 below 2^-6
    return _fp8(y, 2, 15, 65536.0, 6.103515625e-05)  # steps of 2^-16 below 2^-14


CODE_MAX = {1: 127.0, 2: 448.0, 3: 57344.0}
