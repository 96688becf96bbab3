"""Batched LoRA on a mixture-of-experts layer's routed experts: per adapter slot and expert, a low-rank delta on
the gate/up projection and on the down projection, applied inside the experts' loop to the rows routed there.

Adapters come in two forms, both per expert: PEFT's ``target_parameters`` on a fused expert tensor
(``experts.gate_up_proj``: one rank block whose B spans gate and up rows; ``experts.down_proj``) and, from
checkpoints whose experts were separate linears, ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (a rank
block each for gate and up). Expert ``e``'s gate/up slot holds ``2 * max_rank`` ranks (gate's block, then up's),
its down slot ``max_rank``; B is kept transposed with the scale folded in, as ``layers.lora.LoRALayer``.

The tokens a layer routes to an expert each carry their sequence's slot (``LoRAMapping``); one expert's rows
take every slot in the step's span in two matmuls, a row keeping its own slot's ranks (the mapping's mask).

Under tensor parallelism the deltas split as the experts do: gate/up's B keeps this rank's gate rows and up rows
(A whole); down's A keeps this rank's intermediate columns (B whole), its partial delta summed by the experts'
all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pluginfer.layers.lora import LoRAMapping, check_pair

GATE_UP, DOWN = 0, 1
# an adapter part -> (the slot it fills, its rank block, and for gate/up each (block of B's rows in the checkpoint,
# half of this rank's gate|up outputs) it lands on; None: down, whose A is split instead)
PARTS = {"gate": (GATE_UP, 0, ((0, 0),)), "up": (GATE_UP, 1, ((0, 1),)), "gate_up": (GATE_UP, 0, ((0, 0), (1, 1))),
         "down": (DOWN, 0, None)}


@dataclass(frozen=True)
class ExpertShapes:
    """What an adapter of a layer's routed experts must fit (the checkpoint's sizes, every rank's together).
    Picklable: pipeline stages share them."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    max_rank: int

    def of(self, part: str) -> tuple[int, int]:
        """(inputs of A, outputs of B) of a checkpoint's ``part`` of one expert."""
        hidden, intermediate = self.hidden_size, self.intermediate_size
        return {"gate": (hidden, intermediate), "up": (hidden, intermediate), "gate_up": (hidden, 2 * intermediate),
                "down": (intermediate, hidden)}[part]

    def check(self, part: str, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """Shapes of one expert's ``A [r, in]`` and ``B [out, r]`` for ``part``; a ValueError naming ``name``."""
        check_pair(a, b, *self.of(part), self.max_rank, name, f"the experts' {part} projection")


class ExpertLoRA:
    """The adapters of one layer's ``num_experts`` routed experts in ``max_loras`` slots of rank up to
    ``max_rank``. ``shard_size``: this rank's share of ``intermediate_size``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, shard_size: int, tp_rank: int,
                 max_loras: int, max_rank: int, mapping: LoRAMapping, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.shapes = ExpertShapes(num_experts, hidden_size, intermediate_size, max_rank)
        self.shard_size, self.tp_rank, self.mapping = shard_size, tp_rank, mapping
        shape = (num_experts, max_loras)  # expert first: one expert's slots are one contiguous block
        # A [.., ranks, inputs] and B^T [.., ranks, outputs] of gate/up (2 rank blocks) and of down (1)
        self.a = (torch.zeros(*shape, 2 * max_rank, hidden_size, dtype=dtype, device=device),
                  torch.zeros(*shape, max_rank, shard_size, dtype=dtype, device=device))
        self.b = (torch.zeros(*shape, 2 * max_rank, 2 * shard_size, dtype=dtype, device=device),
                  torch.zeros(*shape, max_rank, hidden_size, dtype=dtype, device=device))
        self.held = np.zeros(max_loras, bool)  # slots holding an adapter on these experts

    def set_slot(self, slot: int, parts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Load slot ``slot`` with (expert, part) -> (A, B, scale); experts and parts not named get no adapter."""
        self.clear_slot(slot)
        size, start, full = self.shard_size, self.tp_rank * self.shard_size, self.shapes.intermediate_size
        for (expert, part), (a, b, scale) in parts.items():
            which, block, halves = PARTS[part]
            rank, first = a.shape[0], block * self.shapes.max_rank
            precise = b.to(torch.promote_types(self.b[which].dtype, torch.float32)) * scale  # scaled, then rounded
            if halves is None:  # down: this rank's intermediate inputs
                a, columns = a[:, start:start + size], [(precise, slice(None))]
            else:  # this rank's gate rows and up rows
                columns = [(precise[row * full + start:][:size], slice(half * size, (half + 1) * size))
                           for row, half in halves]
            self.a[which][expert, slot, first:first + rank] = a.to(self.a[which].dtype)
            for rows, where in columns:
                self.b[which][expert, slot, first:first + rank, where] = rows.t().to(self.b[which].dtype)
        self.held[slot] = bool(parts)

    def clear_slot(self, slot: int) -> None:
        for tensor in (*self.a, *self.b):
            tensor[:, slot].zero_()
        self.held[slot] = False

    @property
    def active(self) -> bool:
        """Whether a token of this step uses a slot holding an adapter on these experts."""
        mapping = self.mapping
        if mapping.whole is not None:
            return bool(self.held[mapping.whole])
        return mapping.span is not None and bool(self.held[mapping.span[0]:mapping.span[1]].any())

    def add(self, which: int, expert: int, x: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add to ``out`` (expert ``expert``'s gate/up or down output for rows ``x``) each row's adapter delta;
        ``tokens``: the step's token row of each of ``x``'s rows."""
        a, b, mapping = self.a[which][expert], self.b[which][expert], self.mapping
        x = x.to(a.dtype)
        if mapping.whole is not None:
            slot = mapping.whole
            out.add_(((x @ a[slot].t()) @ b[slot]).to(out.dtype))
            return
        first, end = mapping.span
        width = a.shape[1]
        shrunk = x @ a[first:end].reshape(-1, a.shape[2]).t()  # [rows, span * width]
        shrunk.mul_(mapping.mask(width, a.dtype)[tokens])
        out.add_((shrunk @ b[first:end].reshape(-1, b.shape[2])).to(out.dtype))
