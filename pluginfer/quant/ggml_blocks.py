"""llama.cpp's GGML tensor types in torch: byte layout, dequantization and the matmul.

Types are ``gguf.GGMLQuantizationType`` members or their ints. ``row_bytes(qtype, cols)``; ``dequantize(raw,
qtype, cols, dtype)`` from uint8 ``[rows, row_bytes]`` as a GGUF file stores it, bit-exact with
``gguf.quants.dequantize`` (NaNs stay NaNs); ``ggml_linear(x, raw, qtype, cols, bias, dequantize_rows=None)``,
a tile of rows dequantized at a time, a backend's native dequantization or fused int8-activation matmul
(``quant_matmul``, up to ``QUANT_MATMUL_MAX_ROWS`` rows) where it has one. Quantizing is ``ggml_quantize.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pluginfer.quant.tiled import tile_buffer, tile_compute_dtype, tile_into_buffer, tiled_linear

T = GGMLQuantizationType
QK_K = 256


def as_qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    return GGMLQuantizationType(int(qtype))


def block_size(qtype: GGMLQuantizationType | int) -> int:
    """Weights per block (1 for the float types)."""
    return GGML_QUANT_SIZES[as_qtype(qtype)][0]


def row_bytes(qtype: GGMLQuantizationType | int, cols: int) -> int:
    """Bytes of one row of ``cols`` weights."""
    qtype = as_qtype(qtype)
    size, type_size = GGML_QUANT_SIZES[qtype]
    if cols % size:
        raise ValueError(f"a row of {qtype.name} holds whole blocks of {size} weights, got {cols} columns")
    return cols // size * type_size


# --------------------------------------------------------------------------- dequantization
# Each function takes blocks uint8 [n, type_size] and returns float32 [n, block_size]; scaling
# works in place on the fresh float levels (the same IEEE products, one allocation fewer).


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per row, little-endian fp16, as float32 ``[n, 1]``."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` bytes to ``[n, 2, m]``: the low nibbles, then the high ones."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=1)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, m]`` bytes to ``[n, 8 // width, m]``: bit fields of ``width`` bits, lowest first."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(1) >> shifts[:, None]) & ((1 << width) - 1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes per row, a little-endian uint32 bit mask, to ``[n, 32]`` bits (bit i at column i)."""
    return _bits(qh, 1).transpose(1, 2).reshape(qh.shape[0], 32)


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _f16(blocks[:, :2]), blocks[:, 2:]
    q = _nibbles(qs).reshape(-1, 32).to(torch.int8) - 8
    return q.float().mul_(d)


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qs = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), blocks[:, 4:]
    return _nibbles(qs).reshape(-1, 32).float().mul_(d).add_(m)


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _nibbles(qs).reshape(-1, 32) | (_high_bits(qh) << 4)


def _dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qh, qs = _f16(blocks[:, :2]), blocks[:, 2:6], blocks[:, 6:]
    return (_five_bit(qh, qs).to(torch.int8) - 16).float().mul_(d)


def _dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qh, qs = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), blocks[:, 4:8], blocks[:, 8:]
    return _five_bit(qh, qs).float().mul_(d).add_(m)


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float().mul_(_f16(blocks[:, :2]))


def _dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    # Two halves of 32 bytes, each holding four 2-bit planes of 32 weights.
    q = _bits(qs.reshape(n * 2, 32), 2).reshape(n, 16, 16).float()
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
    # 16 six-bit scales: low nibbles in bytes 0-7 (two per byte), high 2-bit pairs in bytes 8-11.
    low = _bits(packed[:, :8], 4).reshape(n, 16)
    high = _bits(packed[:, 8:], 2).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).reshape(n, 16, 1)
    ql = _bits(qs.reshape(n * 2, 32), 2).reshape(n, 16, 16)
    qh = _bits(hmask, 1).reshape(n, 16, 16) ^ 1  # the offset of 4 applies where the mask bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return q.mul_(dl).reshape(n, QK_K)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes to 8 six-bit scales and 8 six-bit mins (``get_scale_min_k4``)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scales, mins


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, qs = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), blocks[:, 16:]
    scales, mins = _k_scale_min(blocks[:, 4:16])
    dl = (d * scales.float()).reshape(n, 8, 1)
    ml = (dmin * mins.float()).reshape(n, 8, 1)
    q = _nibbles(qs.reshape(n * 4, 32)).reshape(n, 8, 32).float()
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, qh, qs = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), blocks[:, 16:48], blocks[:, 48:]
    scales, mins = _k_scale_min(blocks[:, 4:16])
    dl = (d * scales.float()).reshape(n, 8, 1)
    ml = (dmin * mins.float()).reshape(n, 8, 1)
    ql = _nibbles(qs.reshape(n * 4, 32)).reshape(n, 8, 32)
    q = (ql | (_bits(qh, 1) << 4)).float()
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _f16(blocks[:, 208:210])
    dl = (d * scales.view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(ql.reshape(n * 2, 64)).reshape(n, 8, 32)
    high = _bits(qh.reshape(n * 2, 32), 2).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return q.mul_(dl).reshape(n, QK_K)


_DEQUANTIZE = {
    T.F32: lambda blocks: blocks.contiguous().view(torch.float32),
    T.F16: lambda blocks: blocks.contiguous().view(torch.float16).float(),
    T.BF16: lambda blocks: blocks.contiguous().view(torch.bfloat16).float(),  # widening shifts the bits
    T.Q4_0: _dequantize_q4_0,
    T.Q4_1: _dequantize_q4_1,
    T.Q5_0: _dequantize_q5_0,
    T.Q5_1: _dequantize_q5_1,
    T.Q8_0: _dequantize_q8_0,
    T.Q2_K: _dequantize_q2_k,
    T.Q3_K: _dequantize_q3_k,
    T.Q4_K: _dequantize_q4_k,
    T.Q5_K: _dequantize_q5_k,
    T.Q6_K: _dequantize_q6_k,
}
DEQUANTIZABLE = frozenset(_DEQUANTIZE)


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType | int, cols: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 ``[..., row_bytes]`` as the GGUF file stores it to ``[..., cols]`` in ``dtype``."""
    qtype = as_qtype(qtype)
    if qtype not in _DEQUANTIZE:
        raise ValueError(f"cannot dequantize GGML type {qtype.name}; supported: "
                         f"{', '.join(t.name for t in _DEQUANTIZE)}")
    expected = row_bytes(qtype, cols)
    if raw.dtype != torch.uint8 or raw.shape[-1] != expected:
        raise ValueError(f"{qtype.name} rows of {cols} weights are {expected} uint8 bytes, "
                         f"got {raw.dtype} of shape {tuple(raw.shape)}")
    if (qtype, dtype) in ((T.F16, torch.float16), (T.BF16, torch.bfloat16)):
        return raw.contiguous().view(dtype)  # the stored values themselves, no float32 round trip
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(-1, type_size)
    return _DEQUANTIZE[qtype](blocks).reshape(*raw.shape[:-1], cols).to(dtype)


# ``(raw, qtype, cols, out) -> float32 [rows, cols]`` or None: a backend's native dequantization
# (``DeviceBackend.op("ggml_dequantize")``), bit-exact with ``dequantize``.
DequantizeKernel = Callable[[torch.Tensor, int, int, "torch.Tensor | None"], "torch.Tensor | None"]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused matmul's rounding of the activations (``native_quant.ggml_quant_matmul``), in torch.

    Float ``[..., cols]`` (``cols`` a multiple of 32) to int8 levels ``[..., cols]`` and float32 scales
    ``[..., cols / 32]``, per block of 32 as llama.cpp's ``quantize_row_q8_0``: ``d = max|x| / 127``,
    ``levels = round_half_even(x * (127 / max|x|))`` in float32 (the scale stays float32, not fp16).
    A block of zeros, or one whose ``max|x|`` is below ~3.7e-37 (``127 / max|x|`` overflows), is all zero
    with scale 0; a block holding a NaN or an infinity has zero levels and a NaN scale, so every output
    of its row is NaN. The kernel multiplies the weights with exactly ``levels * scales``."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(blocks).all(dim=-1)
    inverse = torch.where(amax != 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    usable = finite & torch.isfinite(inverse)
    inverse = torch.where(usable, inverse, torch.zeros_like(inverse))
    levels = torch.where(usable[..., None], torch.round(blocks * inverse[..., None]), torch.zeros_like(blocks))
    scales = torch.where(usable, amax / 127, torch.zeros_like(amax))
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    return levels.to(torch.int8).reshape(x.shape), scales


# Up to this many rows (tokens) of ``x`` a linear runs the backend's fused int8-activation matmul when it
# has one; more rows dequantize tiles for the float GEMM, which is as fast from ~128 rows and faster
# beyond (one core, 5632 x 1024: 3-8 % slower than fused at 128 rows, 4-7 % faster at 256).
# A backend's op may set its own (``quant_matmul_max_rows``: the cpu backend's is
# lower where its tiles are bfloat16 for an AMX GEMM).
QUANT_MATMUL_MAX_ROWS = 128


def ggml_linear(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType | int, cols: int,
                bias: torch.Tensor | None, dequantize_rows: DequantizeKernel | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W = dequantize(raw, qtype, cols)``, one tile of output rows at a time.

    With ``dequantize_rows`` (a native kernel) each tile is dequantized by it, for float32 ``x``
    into one reused buffer (a tile is consumed by its matmul before the next is written); the
    torch ``dequantize`` remains the path for the types the kernel declines (it returns None).
    When the kernel carries a ``quant_matmul`` (the cpu backend's fused int8-activation matmul,
    ``native_quant.GGMLDequantize``), up to ``QUANT_MATMUL_MAX_ROWS`` rows of ``x`` go through it instead,
    for the types it handles: ``x`` quantized per block of 32 to int8, no float copy of ``W``."""
    on_cpu = dequantize_rows is not None and raw.device.type == "cpu"
    quant_matmul = getattr(dequantize_rows, "quant_matmul", None) if on_cpu else None
    if quant_matmul is not None:  # first: every decode step
        limits = getattr(dequantize_rows, "quant_matmul_max_rows", None)  # by type, where the op has its own
        limit = QUANT_MATMUL_MAX_ROWS if limits is None else limits.get(int(qtype), 0)
        out = quant_matmul(x, raw, int(qtype), cols) if x.numel() <= limit * cols else None
        if out is not None:
            return out if bias is None else out.add_(bias)
    qtype = as_qtype(qtype)
    if not on_cpu:
        return tiled_linear(x, raw.shape[0], lambda start, stop: dequantize(raw[start:stop], qtype, cols, x.dtype),
                            bias)
    dtype = tile_compute_dtype(x, dequantize_rows)
    into_buffer = tile_into_buffer(dtype, dequantize_rows)

    def tile(start: int, stop: int) -> torch.Tensor:
        rows = raw[start:stop]
        buffer = tile_buffer((stop - start) * cols, dtype) if into_buffer else None
        weights = dequantize_rows(rows, int(qtype), cols, buffer)
        if weights is None:
            return dequantize(rows, qtype, cols, dtype)
        return weights if buffer is not None else weights.to(dtype)

    return tiled_linear(x, raw.shape[0], tile, bias, dtype)
