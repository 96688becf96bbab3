"""Batched LoRA: one linear layer's adapters in a bounded slot table, applied to a whole flat batch at once.

Every token row of a step carries the slot of its sequence's adapter (-1: the base model). A layer adds
``x @ A[slot]^T @ B[slot]^T`` (the scale folded into B) to its base output for the whole flat batch in two
matmuls (see ``LoRAMapping``): no loop over adapters, sequences or tokens. The base output is whatever the
layer's quant method computed, so quantized base weights (GGUF, int8, ...) take adapters too.

A fused layer (QKV, gate/up) holds one rank block per projection: slot ``s``'s A is ``[k * max_rank, in]``
(projection ``i``'s A in rows ``i * max_rank:``) and its B, kept transposed as ``[k * max_rank, out]``, is
block diagonal. An adapter of a lower rank fills the first rows of its block (the rest stay zero), so adapters
of every rank up to ``max_rank`` share one batch.

Under tensor parallelism an adapter is split as the layer it modifies: a column-parallel layer's B keeps this
rank's output rows (A whole); a row-parallel layer's A keeps this rank's input columns (B whole), and its partial
delta is summed by the layer's own all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pluginfer.core.kernels import define_op
from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.linear import projection_rows


@define_op
def lora_sgmv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, order: torch.Tensor,
              group_slots: torch.Tensor, group_starts: torch.Tensor, max_group_rows: int) -> bool:
    """Grouped LoRA matmul (punica's SGMV): for each group ``g``, the rows ``order[group_starts[g]:group_starts[g +
    1]]`` of ``x [T, K]`` times ``weight[group_slots[g]]`` (``weight [S, K, N]``, any strides) are added to the same
    rows of ``out [T, N]`` in place: products summed in float32, added to ``out`` in float32, rounded once to its
    dtype; rows in no group are left alone. ``max_group_rows``: the most rows of a group (a host int, for a grid).
    False from a kernel: inputs it does not take (the caller runs its torch path)."""
    starts = group_starts.tolist()
    for g, slot in enumerate(group_slots.tolist()):
        rows = order[starts[g]:starts[g + 1]]
        out[rows] = (out[rows].float() + x[rows].float() @ weight[slot].float()).to(out.dtype)
    return True


class LoRAMapping:
    """The step's token -> slot map, shared by every LoRA layer of a model.

    One adapter for every token (``whole``): one matmul pair over the batch. Several (or some base rows): the
    slots ``span`` from the lowest to the highest active one are applied to every token at once, each token
    keeping only its own adapter's ranks (``onehot``, a token's row of zeros for the base): two matmuls per
    layer whatever the number of adapters, S-LoRA's batched gather without a gather of weights.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.whole: int | None = None  # the slot of every token
        self.span: tuple[int, int] | None = None  # [first, last + 1) slots the tokens use
        self.onehot: torch.Tensor | None = None  # [tokens, span]: 1 where a token uses the slot
        # (order, group slots, group starts, most rows of a group): the adapted rows grouped by slot, for lora_sgmv
        self.groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return self.whole is not None or self.span is not None

    def set(self, token_slots: np.ndarray) -> None:
        """``token_slots[t]``: the slot of token row ``t`` (-1: no adapter)."""
        self.clear()
        used = token_slots[token_slots >= 0]
        if not used.size:
            return
        first, last = int(used.min()), int(used.max())
        if first == last and used.size == token_slots.size:
            self.whole = first
            return
        onehot = np.zeros((token_slots.size, last + 1 - first), np.float32)
        rows = np.flatnonzero(token_slots >= 0)
        onehot[rows, token_slots[rows] - first] = 1.0
        self.span, self.onehot = (first, last + 1), torch.from_numpy(onehot).to(self.device)
        order = rows[np.argsort(token_slots[rows], kind="stable")]
        slots, counts = np.unique(token_slots[order], return_counts=True)
        starts = np.concatenate([[0], np.cumsum(counts)])
        self.groups = (torch.from_numpy(order).to(self.device), torch.from_numpy(slots).to(self.device),
                       torch.from_numpy(starts).to(self.device), int(counts.max()))

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``[tokens, span * width]``: the onehot widened to each slot's ``width`` ranks (made once a step)."""
        mask = self._masks.get((width, dtype))
        if mask is None:
            mask = self._masks[(width, dtype)] = self.onehot.to(dtype).repeat_interleave(width, dim=1)
        return mask

    def clear(self) -> None:
        self.whole = self.span = self.onehot = self.groups = None
        self._masks = {}


def check_pair(a: torch.Tensor, b: torch.Tensor, inputs: int, outputs: int, max_rank: int, name: str,
               what: str) -> None:
    """An adapter module's ``A [r, in]`` and ``B [out, r]``: ``r`` within ``max_rank``, ``in``/``out`` those of
    ``what`` (the layer or projection it adapts); a ValueError naming ``name``."""
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise ValueError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] and [out, r]")
    if rank > max_rank:
        raise ValueError(f"{name}: rank {rank} is above max_lora_rank {max_rank} (--max-lora-rank)")
    if (a.shape[1], b.shape[0]) != (inputs, outputs):
        raise ValueError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit {what} "
                         f"({inputs} inputs, {outputs} outputs)")


@dataclass(frozen=True)
class LinearShapes:
    """What an adapter of a linear layer must fit: the layer's inputs and its projections' outputs in the
    checkpoint (every rank's together), and the rank limit. Picklable: pipeline stages share them."""

    input_size: int
    output_sizes: tuple[int, ...]
    max_rank: int

    def check(self, index: int, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """Shapes of projection ``index``'s ``A [r, in]`` and ``B [out, r]``; a ValueError naming ``name``."""
        check_pair(a, b, self.input_size, self.output_sizes[index], self.max_rank, name, "the layer")


class LoRALayer:
    """The adapters of one linear layer: ``max_loras`` slots of rank up to ``max_rank`` per projection.

    ``input_size``: this rank's inputs of the layer; ``shard``: the layer's split (``output_sizes`` the checkpoint's
    projections, which an adapter's shapes are checked against); ``kernel``: the backend's ``lora_sgmv`` (None: the
    torch ops of ``LoRAMapping``)."""

    def __init__(self, input_size: int, shard: ShardSpec, max_loras: int, max_rank: int,
                 mapping: LoRAMapping, dtype: torch.dtype, device: torch.device | str,
                 kernel: Callable | None = None) -> None:
        self.shard, self.max_rank, self.mapping, self.kernel = shard, max_rank, mapping, kernel
        self.input_size, self.output_sizes = input_size, list(shard.output_sizes)
        self.shapes = LinearShapes(input_size * shard.size if shard.dim == 1 else input_size,
                                   tuple(self.output_sizes), max_rank)
        self.rows = [projection_rows(shard, i) for i in range(len(self.output_sizes))]  # (start, rows, offset)
        width = len(self.output_sizes) * max_rank
        self.a = torch.zeros(max_loras, width, input_size, dtype=dtype, device=device)
        out = sum(rows for _, rows, _ in self.rows)
        self.b = torch.zeros(max_loras, width, out, dtype=dtype, device=device)  # B^T per slot

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Load slot ``slot`` with projection index -> (A, B, scale); projections not named get no adapter."""
        self.clear_slot(slot)
        for index, (a, b, scale) in parts.items():
            rank, first = a.shape[0], index * self.max_rank
            if self.shard.dim == 1 and self.shard.size > 1:  # row parallel: this rank's inputs
                a = self.shard.narrow(a, 1, self.input_size)
            start, rows, offset = self.rows[index]
            b = b[start:start + rows]  # column parallel: this rank's outputs (every row otherwise)
            self.a[slot, first:first + rank] = a.to(self.a.dtype)
            columns = slice(offset, offset + rows)
            precise = torch.promote_types(self.b.dtype, torch.float32)  # scaled before a 16-bit rounding
            self.b[slot, first:first + rank, columns] = (b.to(precise) * scale).t().to(self.b.dtype)

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base layer's output for ``x``) plus each token's adapter delta."""
        mapping = self.mapping
        if not mapping.active:
            return out
        flat_x, flat_out = x.reshape(-1, x.shape[-1]).to(self.a.dtype), out.view(-1, out.shape[-1])
        if mapping.whole is not None:
            slot = mapping.whole
            flat_out.add_(((flat_x @ self.a[slot].t()) @ self.b[slot]).to(out.dtype))
            return out
        width = self.a.shape[1]
        if self.kernel is not None:  # shrink then expand, each adapter's rows grouped: one launch each
            shrunk = torch.zeros(flat_x.shape[0], width, dtype=torch.float32, device=flat_x.device)
            if self.kernel(flat_x, self.a.transpose(1, 2), shrunk, *mapping.groups):
                if not self.kernel(shrunk, self.b, flat_out, *mapping.groups):
                    lora_sgmv(shrunk, self.b, flat_out, *mapping.groups)
                return out
        first, end = mapping.span
        a = self.a[first:end].reshape(-1, self.input_size)  # [span * width, in], a view
        b = self.b[first:end].reshape(-1, self.b.shape[2])  # [span * width, out], a view
        shrunk = (flat_x @ a.t()).mul_(mapping.mask(width, self.a.dtype))
        flat_out.add_((shrunk @ b).to(out.dtype))
        return out
