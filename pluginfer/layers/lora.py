"""Batched LoRA: one linear layer's adapters in a bounded slot table, applied to a flat batch grouped by adapter.

Every token row of a step carries the slot of its sequence's adapter (-1: the base model). A layer adds
``x @ A[slot]^T @ B[slot]^T`` (the scale folded into B) to its base output once per adapter active in the
step, over that adapter's rows at once (punica / S-LoRA's grouping, in torch ops): the loop runs over the
few active adapters, never over sequences or tokens. The base output is whatever the layer's quant method
computed, so quantized base weights (GGUF, int8, ...) take adapters too.

A fused layer (QKV, gate/up) holds one rank block per projection: slot ``s``'s A is ``[k * max_rank, in]``
(projection ``i``'s A in rows ``i * max_rank:``) and its B ``[out, k * max_rank]`` is block diagonal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class LoRAMapping:
    """The step's token -> slot map, shared by every LoRA layer of a model: (slot, token rows) per adapter."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # rows None: every token of the step

    def set(self, token_slots: np.ndarray) -> None:
        """``token_slots[t]``: the slot of token row ``t`` (-1: no adapter)."""
        slots = np.unique(token_slots)
        slots = slots[slots >= 0]
        if len(slots) == 1 and bool((token_slots == slots[0]).all()):
            self.groups = [(int(slots[0]), None)]
            return
        self.groups = [(int(slot), torch.from_numpy(np.flatnonzero(token_slots == slot)).to(self.device))
                       for slot in slots]

    def clear(self) -> None:
        self.groups = []


class LoRALayer:
    """The adapters of one linear layer: ``max_loras`` slots of rank up to ``max_rank`` per projection."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], max_loras: int, max_rank: int,
                 mapping: LoRAMapping, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.max_rank, self.mapping = max_rank, mapping
        width = len(self.output_sizes) * max_rank
        self.a = torch.zeros(max_loras, width, input_size, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, sum(self.output_sizes), width, dtype=dtype, device=device)
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]

    def check(self, index: int, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """Shapes of projection ``index``'s ``A [r, in]`` and ``B [out, r]``; a ValueError naming ``name``."""
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] and [out, r]")
        if rank > self.max_rank:
            raise ValueError(f"{name}: rank {rank} is above max_lora_rank {self.max_rank} (--max-lora-rank)")
        if a.shape[1] != self.input_size or b.shape[0] != self.output_sizes[index]:
            raise ValueError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the layer "
                             f"({self.input_size} inputs, {self.output_sizes[index]} outputs)")

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Load slot ``slot`` with projection index -> (A, B); projections not named get no adapter."""
        self.clear_slot(slot)
        for index, (a, b) in parts.items():
            rank, first = a.shape[0], index * self.max_rank
            self.a[slot, first:first + rank] = a.to(self.a.dtype)
            rows = slice(self.offsets[index], self.offsets[index] + self.output_sizes[index])
            self.b[slot, rows, first:first + rank] = (b.float() * scale).to(self.b.dtype)

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base layer's output for ``x``) plus each token's adapter delta."""
        groups = self.mapping.groups
        if not groups:
            return out
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for slot, rows in groups:
            xs = flat_x if rows is None else flat_x.index_select(0, rows)
            delta = (xs.to(self.a.dtype) @ self.a[slot].t()) @ self.b[slot].t()
            if rows is None:
                flat_out.add_(delta.to(out.dtype))
            else:
                flat_out.index_add_(0, rows, delta.to(out.dtype))
        return out
