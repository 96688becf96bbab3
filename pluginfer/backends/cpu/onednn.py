"""oneDNN's prepacked float32 linear on the CPU (``torch.ops.mkldnn``), for batched decode.

MKL's GEMM spends most of a 2-64 row matmul repacking the weight at every call; oneDNN packs it
once into its own blocked layout. A single row costs a little more than MKL's GEMV, so layouts are
chosen per engine (``max_num_seqs``).
"""

from __future__ import annotations

import torch

# The row count oneDNN packs for; 4 ran batches of 2-64 best here.
ROWS_HINT = 4


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def worth_packing(weight: torch.Tensor, batched: bool) -> bool:
    """Pack float32 CPU weights of engines that batch sequences, where this torch has oneDNN."""
    return batched and weight.device.type == "cpu" and weight.dtype == torch.float32 and available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` dense weight -> an opaque oneDNN tensor for :func:`linear` (the dense copy can go)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` over any leading dims of ``x``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
