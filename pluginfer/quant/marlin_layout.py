"""The Marlin weight layout (IST-DASLab ``marlin``, mirrored by GPTQModel and vLLM), in plain torch.

A 4-bit ``[in, out]`` weight is cut into 16x16 tiles, each row of 16 inputs one row of ``B`` ``[k / 16, n * 2]``
int32; within every run of four tiles (64 outputs) the codes are reordered so a GPU warp's tensor-core fragment
is contiguous, each eight interleaved ``[0, 2, 4, 6, 1, 3, 5, 7]``, lowest nibble first. Scales are permuted
within runs of 64 columns (grouped) or 32 (``group_size == -1``); AWQ zero points take the grouped order, then
the interleave. ``pack_*`` builds the layout, ``unpack_*`` is its exact inverse.
"""

from __future__ import annotations

import torch

from pluginfer.core.kernels import define_op

TILE = 16  # the tile is 16 input rows x 16 output columns
# the weight permutation acts on runs of four tiles: 64 output columns
CHUNK_COLUMNS = 64
INTERLEAVE_4BIT = (0, 2, 4, 6, 1, 3, 5, 7)
PACK = 8  # 4-bit codes per int32


def tile_permutation() -> torch.Tensor:
    """Order (before the interleave) of the 1024 codes of four consecutive 16x16 tiles.

    Entry ``p`` is the index into the row-major run ``[tile (4), row (16), column (16)]`` of the
    code stored at position ``p``. Thread ``t`` of a warp owns rows ``2(t%4), 2(t%4)+1, 2(t%4)+8,
    2(t%4)+9`` of column ``t//4`` in both 8-column halves (the mma.m16n8k16 B fragment).
    """
    order = []
    for thread in range(32):
        column = thread // 4
        fragment = []
        for half in (0, 1):
            for row in (2 * (thread % 4), 2 * (thread % 4) + 1, 2 * (thread % 4 + 4), 2 * (thread % 4 + 4) + 1):
                fragment.append(TILE * row + column + 8 * half)
        for tile in range(4):
            order.extend(index + TILE * TILE * tile for index in fragment)
    return torch.tensor(order, dtype=torch.long)


def weight_permutation() -> torch.Tensor:
    """The tile permutation followed by the 4-bit interleave: position -> source in a 1024-code run."""
    interleave = torch.tensor(INTERLEAVE_4BIT, dtype=torch.long)
    return tile_permutation().reshape(-1, PACK)[:, interleave].reshape(-1)


_POSITION_TABLES: dict[torch.device, torch.Tensor] = {}


def position_table(device: torch.device) -> torch.Tensor:
    """int32 ``[16 * 64]``: where, in its 1024-code run, the code of (tile row ``r``, run column ``c``) sits.

    What a kernel reading ``B`` tile by tile needs of the permutation (the ``marlin_matmul`` op's ``positions``).
    """
    table = _POSITION_TABLES.get(device)
    if table is None:
        where = torch.argsort(weight_permutation())  # source index -> position
        row = torch.arange(TILE)[:, None]
        column = torch.arange(CHUNK_COLUMNS)[None, :]
        source = TILE * TILE * (column // TILE) + TILE * row + column % TILE
        table = where[source].reshape(-1).to(device=device, dtype=torch.int32)
        _POSITION_TABLES[device] = table
    return table


def scale_permutation() -> torch.Tensor:
    """Grouped scales: position ``8i + j`` of each 64-column run holds column ``i + 8j``."""
    return torch.tensor([i + 8 * j for i in range(8) for j in range(8)], dtype=torch.long)


def scale_permutation_single() -> torch.Tensor:
    """Per-column scales (one group): each 32-column run, in the order the fragments read them."""
    return torch.tensor([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)], dtype=torch.long)


def check_shape(size_k: int, size_n: int, group_size: int) -> None:
    """The layout needs whole 16-row tiles, whole 64-column runs and whole groups."""
    if size_k % TILE:
        raise ValueError(f"marlin: input size {size_k} is not a multiple of {TILE}")
    if size_n % CHUNK_COLUMNS:
        raise ValueError(f"marlin: output size {size_n} is not a multiple of {CHUNK_COLUMNS}")
    if group_size != -1 and size_k % group_size:
        raise ValueError(f"marlin: input size {size_k} is not a multiple of the group size {group_size}")


def pack_int4_columns(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, 8c]`` codes 0..15 -> ``[rows, c]`` int32, code ``8j + i`` in bits ``4i..4i+3`` of word ``j``."""
    codes = codes.to(torch.int64).reshape(codes.shape[0], -1, PACK)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (codes << shifts).sum(dim=-1)  # nibbles are disjoint: the sum is a bitwise or
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4_columns(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_columns`: int32 ``[rows, c]`` -> int32 codes ``[rows, 8c]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], -1)


def grouped_scales(size_k: int, group_size: int) -> bool:
    """Whether scales of a ``size_k``-input layer take the grouped permutation (several groups) or the single one."""
    return group_size != -1 and group_size < size_k


def _scale_perm(size_k: int, group_size: int) -> torch.Tensor:
    return scale_permutation() if grouped_scales(size_k, group_size) else scale_permutation_single()


def permute_scales(scales: torch.Tensor, size_k: int, group_size: int) -> torch.Tensor:
    """Scales ``[groups, n]`` in column order -> the Marlin order (same shape)."""
    perm = _scale_perm(size_k, group_size).to(scales.device)
    return scales.reshape(-1, perm.numel())[:, perm].reshape(scales.shape).contiguous()


def unpermute_scales(scales: torch.Tensor, size_k: int, group_size: int) -> torch.Tensor:
    perm = _scale_perm(size_k, group_size).to(scales.device)
    out = torch.empty_like(scales).reshape(-1, perm.numel())
    out[:, perm] = scales.reshape(-1, perm.numel())
    return out.reshape(scales.shape)


def pack_weight(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[k, n]`` (0..15) -> Marlin tiles ``B`` int32 ``[k / 16, n * 2]``."""
    size_k, size_n = codes.shape
    check_shape(size_k, size_n, -1)
    tiles = codes.reshape(size_k // TILE, TILE, size_n // TILE, TILE).permute(0, 2, 1, 3)
    rows = tiles.reshape(size_k // TILE, size_n * TILE)
    perm = weight_permutation().to(codes.device)
    rows = rows.reshape(-1, perm.numel())[:, perm].reshape(rows.shape)
    return pack_int4_columns(rows)


def unpack_weight(packed: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: ``B`` -> int32 codes ``[k, n]``."""
    if packed.shape != (size_k // TILE, size_n * TILE // PACK):
        raise ValueError(f"marlin: B has shape {tuple(packed.shape)}, expected "
                         f"{(size_k // TILE, size_n * TILE // PACK)} for a {size_k}x{size_n} weight")
    rows = unpack_int4_columns(packed)
    perm = weight_permutation().to(packed.device)
    ordered = torch.empty_like(rows).reshape(-1, perm.numel())
    ordered[:, perm] = rows.reshape(-1, perm.numel())
    tiles = ordered.reshape(size_k // TILE, size_n // TILE, TILE, TILE).permute(0, 2, 1, 3)
    return tiles.reshape(size_k, size_n).contiguous()


def pack_zero_points(zeros: torch.Tensor) -> torch.Tensor:
    """Zero points ``[groups, n]`` (0..15) -> int32 ``[groups, n / 8]``: grouped scale order, interleaved."""
    groups, size_n = zeros.shape
    ordered = zeros.reshape(-1, CHUNK_COLUMNS)[:, scale_permutation().to(zeros.device)]
    ordered = ordered.reshape(-1, PACK)[:, torch.tensor(INTERLEAVE_4BIT, device=zeros.device)]
    return pack_int4_columns(ordered.reshape(groups, size_n))


def unpack_zero_points(packed: torch.Tensor, size_n: int) -> torch.Tensor:
    groups = packed.shape[0]
    ordered = unpack_int4_columns(packed).reshape(-1, PACK)
    interleave = torch.tensor(INTERLEAVE_4BIT, device=packed.device)
    deinterleaved = torch.empty_like(ordered)
    deinterleaved[:, interleave] = ordered
    zeros = torch.empty_like(deinterleaved).reshape(-1, CHUNK_COLUMNS)
    zeros[:, scale_permutation().to(packed.device)] = deinterleaved.reshape(-1, CHUNK_COLUMNS)
    return zeros.reshape(groups, size_n)


def pack(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``[k, n]``, scales ``[groups, n]``) -> (``B`` ``[k/16, 2n]`` int32, permuted scales)."""
    size_k, size_n = codes.shape
    check_shape(size_k, size_n, group_size)
    groups = 1 if group_size == -1 else size_k // group_size
    if scales.shape != (groups, size_n):
        raise ValueError(f"marlin: scales have shape {tuple(scales.shape)}, expected {(groups, size_n)}")
    return pack_weight(codes), permute_scales(scales, size_k, group_size)


def unpack(packed: torch.Tensor, scales: torch.Tensor, size_k: int, size_n: int,
           group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: (codes ``[k, n]`` int32, scales ``[groups, n]`` in column order)."""
    return unpack_weight(packed, size_k, size_n), unpermute_scales(scales, size_k, group_size)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, size_k: int, size_n: int, group_size: int,
               zeros: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[k, n]`` weight a Marlin layer holds: ``(code - zero) * scale``; symmetric zero is 8."""
    codes, column_scales = unpack(packed, scales, size_k, size_n, group_size)
    rows_per_group = size_k if group_size == -1 else group_size
    zero = 8 if zeros is None else unpack_zero_points(zeros, size_n).repeat_interleave(rows_per_group, dim=0)
    weight = (codes - zero).float() * column_scales.float().repeat_interleave(rows_per_group, dim=0)
    return weight.to(dtype)


def matmul_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                     zeros: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W (+ bias)`` through the full unpack: the oracle of the Triton kernel (float32 product)."""
    size_k, size_n = packed.shape[0] * TILE, packed.shape[1] * PACK // TILE
    weight = dequantize(packed, scales, size_k, size_n, group_size, zeros)
    out = (x.float() @ weight).to(x.dtype)
    return out if bias is None else out + bias


def is_marlin_checkpoint(quantization_config: dict) -> bool:
    """GPTQ tensors already in Marlin tiles (``checkpoint_format: marlin``, or AutoGPTQ's ``is_marlin_format``)."""
    return quantization_config.get("checkpoint_format") == "marlin" or bool(quantization_config.get("is_marlin_format"))


@define_op
def marlin_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                  zeros: torch.Tensor | None, bias: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """``x @ W (+ bias)`` for a 4-bit weight in the Marlin layout (the layout above); ``x`` ``[..., k]``.

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
