"""Where a dense weight ``[out, in]`` lives once it has loaded, and the matmul that reads it.

On the CPU the checkpoint's layout is replaced, once, by the one the fastest available kernel reads
(docs/performance.md has the measurements: 0.5B-shaped llama, float32, 2 cores):

- ``panels``: the backend's native ``panel_linear`` kernel (``backends/csrc/panel_linear.c``), float32
  on an AVX-512 CPU, whatever the batch: ~1.3x oneDNN's prepacked GEMM at 1-32 rows, faster than
  MKL's GEMV at one, ~0.9x oneDNN at prefill sizes.
- ``onednn``: oneDNN's prepacked layout (``layers/onednn.py``) where that kernel is unavailable and the
  engine batches several sequences (~1.3x MKL at 16 rows, ~10% slower at one).
- ``transposed``: ``[in, out]``, which MKL's GEMV reads fastest, otherwise (and for half precision).
- ``checkpoint``: weights off the CPU keep ``[out, in]`` for ``F.linear``.

Every layout replaces the checkpoint's: the weight is held once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pluginfer.layers import onednn
from pluginfer.layers.context import backend_op


class DenseKernels:
    """The backend's native packed-weight ops, looked up once at build time (``panels``: both exist)."""

    def __init__(self, backend: object) -> None:
        self.pack_panels: Callable | None = backend_op(backend, "pack_panels")
        self.panel_linear: Callable | None = backend_op(backend, "panel_linear")
        self.panels = self.pack_panels is not None and self.panel_linear is not None


def packed_layout(weight: torch.Tensor, batched: bool, kernels: DenseKernels | None) -> str | None:
    """``panels`` or ``onednn`` when :func:`relayout` packs this weight, else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if kernels is not None and kernels.panels:
        return "panels"
    return "onednn" if onednn.worth_packing(weight, batched) else None


def pack(layout: str, weight: torch.Tensor, kernels: DenseKernels | None) -> torch.Tensor:
    """``weight`` ``[out, in]`` in a packed layout :func:`packed_layout` chose."""
    return kernels.pack_panels(weight) if layout == "panels" else onednn.pack(weight)


def relayout(weight: torch.Tensor, batched: bool, kernels: DenseKernels | None) -> tuple[str, torch.Tensor]:
    """(layout name, the weight in it) for a loaded ``[out, in]`` weight; see the module docstring."""
    if weight.device.type != "cpu":
        return "checkpoint", weight
    layout = packed_layout(weight, batched, kernels)
    if layout is not None:
        return layout, pack(layout, weight, kernels)
    return "transposed", weight.t().contiguous()


def linear(layout: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           kernels: DenseKernels | None) -> torch.Tensor:
    """``x @ W^T + bias`` for a weight that :func:`relayout` placed in ``layout``."""
    if layout == "panels":
        return kernels.panel_linear(x, weight, out_features, bias)
    if layout == "onednn":
        return onednn.linear(x, weight, bias)
    if layout == "checkpoint":
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.matmul(x, weight)
    return torch.addmm(bias, x, weight) if x.dim() == 2 else torch.matmul(x, weight) + bias
