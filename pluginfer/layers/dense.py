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


class DenseMatmul:
    """Places loaded ``[out, in]`` weights and multiplies by them, for one engine.

    Built once per layer from the build context: the backend's native packed-weight ops (None where
    it has none; ``panels``: both exist) and whether the engine batches sequences.
    """

    def __init__(self, backend: object, batched: bool) -> None:
        self.pack_panels: Callable | None = backend_op(backend, "pack_panels")
        self.panel_linear: Callable | None = backend_op(backend, "panel_linear")
        self.panels = self.pack_panels is not None and self.panel_linear is not None
        self.batched = batched

    @classmethod
    def for_context(cls, ctx: object) -> DenseMatmul:
        return cls(ctx.backend, ctx.max_num_seqs > 1)

    def packed_layout(self, weight: torch.Tensor) -> str | None:
        """``panels`` or ``onednn`` when :meth:`relayout` packs this weight, else None."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        if self.panels:
            return "panels"
        return "onednn" if onednn.worth_packing(weight, self.batched) else None

    def pack(self, layout: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[out, in]`` in a packed layout :meth:`packed_layout` chose."""
        return self.pack_panels(weight) if layout == "panels" else onednn.pack(weight)

    def relayout(self, weight: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(layout name, the weight in it) for a loaded ``[out, in]`` weight; see the module docstring."""
        if weight.device.type != "cpu":
            return "checkpoint", weight
        layout = self.packed_layout(weight)
        if layout is not None:
            return layout, self.pack(layout, weight)
        return "transposed", weight.t().contiguous()

    def linear(self, layout: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        """``x @ W^T + bias`` for a weight that :meth:`relayout` placed in ``layout``."""
        if layout == "panels":
            return self.panel_linear(x, weight, out_features, bias)
        if layout == "onednn":
            return onednn.linear(x, weight, bias)
        if layout == "checkpoint":
            return F.linear(x, weight, bias)
        if bias is None:
            return torch.matmul(x, weight)
        return torch.addmm(bias, x, weight) if x.dim() == 2 else torch.matmul(x, weight) + bias
