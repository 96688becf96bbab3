"""Where a dense weight ``[out, in]`` lives once it has loaded, and the matmul that reads it.

The backend decides, through its kernel table (ops ``dense_layout``, ``dense_pack``, ``dense_linear`` of
``layers/ops.py``): the cpu backend packs float32 weights for its native panel kernel or oneDNN, or
transposes them for MKL's GEMV (``backends/cpu/dense.py``); a backend that registers none keeps the
checkpoint's layout and ``F.linear``. Layers only carry the layout's name from the one op to the others.
"""

from __future__ import annotations

import torch

from pluginfer.layers import ops
from pluginfer.layers.context import backend_op


class DenseMatmul:
    """Places loaded ``[out, in]`` weights and multiplies by them, for one engine.

    Built once per layer from the build context: the backend's three dense ops (the table's references
    where it has none) and whether the engine batches sequences.
    """

    def __init__(self, backend: object, batched: bool) -> None:
        self._layout = backend_op(backend, "dense_layout") or ops.dense_layout
        self._pack = backend_op(backend, "dense_pack") or ops.dense_pack
        self._linear = backend_op(backend, "dense_linear") or ops.dense_linear
        self.batched = batched

    @classmethod
    def for_context(cls, ctx: object) -> DenseMatmul:
        return cls(ctx.backend, ctx.max_num_seqs > 1)

    def packed_layout(self, weight: torch.Tensor) -> str | None:
        """The backend's packed layout for this weight, or None when it would keep it unpacked."""
        layout = self._layout(weight, self.batched, True)
        return None if layout == "checkpoint" else layout

    def pack(self, layout: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[out, in]`` in a layout the backend named."""
        return self._pack(weight, layout)

    def relayout(self, weight: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(layout name, the weight in it) for a loaded ``[out, in]`` weight."""
        layout = self._layout(weight, self.batched, False)
        return layout, (weight if layout == "checkpoint" else self._pack(weight, layout))

    def linear(self, layout: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        """``x @ W^T + bias`` for a weight :meth:`relayout` placed in ``layout``."""
        return self._linear(x, weight, bias, layout, out_features)
