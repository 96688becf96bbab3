"""Adapters on routed experts: each routed row gets its own slot's deltas on its expert's gate/up and down,
and a tensor-parallel rank's share of them sums to the whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pluginfer.core.protocols import BuildContext, RankInfo
from pluginfer.layers.context import building
from pluginfer.layers.expert_lora import ExpertLoRA, ExpertShapes
from pluginfer.layers.lora import LoRAMapping
from pluginfer.layers.moe import FusedExperts
from pluginfer.layers.router import route
from pluginfer.quant import unquantized
from tests.layers.conftest import backend_with

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, MAX_RANK = 4, 16, 12, 2, 4


class Rank:
    """A collective's rank and size: enough to build one rank's slice of the experts."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def experts_of(rank: int, world: int, weights: tuple[torch.Tensor, torch.Tensor], mapping: LoRAMapping,
               native: bool) -> FusedExperts:
    ctx = BuildContext(backend=backend_with(native), quant=unquantized.build(), collective=Rank(rank, world),
                       dtype=torch.float32, max_model_len=64, max_num_seqs=4,
                       rank=RankInfo(rank=rank, world_size=world, tp_size=world))
    with building(ctx):
        experts = FusedExperts(EXPERTS, HIDDEN, INTERMEDIATE, reduce_results=False)
    experts.weight_loader(experts.gate_up_proj, weights[0])
    experts.weight_loader(experts.down_proj, weights[1])
    experts.process_weights_after_loading()
    experts.lora = ExpertLoRA(EXPERTS, HIDDEN, INTERMEDIATE, experts.shard_size, rank, 3, MAX_RANK, mapping,
                              torch.float32, "cpu")
    return experts


def adapters() -> dict[int, dict]:
    """slot -> (expert, part) -> (A, B, scale): slot 0 fused gate_up and down on every expert (scales 0.5 and
    1.5); slot 2 per-expert gate, up and down on two experts, ranks 2 and 4 (scale 2); slot 1 holds nothing."""
    generator = torch.Generator().manual_seed(1)

    def pair(rank: int, inputs: int, outputs: int, scale: float = 2.0) -> tuple[torch.Tensor, torch.Tensor, float]:
        return (torch.randn(rank, inputs, generator=generator) * 0.3,
                torch.randn(outputs, rank, generator=generator) * 0.3, scale)

    fused = {(e, "gate_up"): pair(3, HIDDEN, 2 * INTERMEDIATE, 0.5) for e in range(EXPERTS)}
    fused |= {(e, "down"): pair(3, INTERMEDIATE, HIDDEN, 1.5) for e in range(EXPERTS)}
    single = {(1, "gate"): pair(2, HIDDEN, INTERMEDIATE), (1, "up"): pair(4, HIDDEN, INTERMEDIATE),
              (3, "down"): pair(4, INTERMEDIATE, HIDDEN), (3, "up"): pair(2, HIDDEN, INTERMEDIATE)}
    return {0: fused, 2: single}


def reference(x: torch.Tensor, weights: tuple, ids: torch.Tensor, topk: torch.Tensor, token_slots: np.ndarray,
              held: dict) -> torch.Tensor:
    """Each token through its experts' weights plus its adapter's scaled B @ A, one token at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up, down = weights[0][e].clone(), weights[1][e].clone()
            if token_slots[t] >= 0:
                for (expert, part), (a, b, scale) in held[int(token_slots[t])].items():
                    if expert != e:
                        continue
                    delta = scale * b @ a
                    if part == "down":
                        down += delta
                    else:
                        rows = {"gate": slice(0, INTERMEDIATE), "up": slice(INTERMEDIATE, None),
                                "gate_up": slice(None)}[part]
                        gate_up[rows] += delta
            gate, up = (gate_up @ x[t]).split(INTERMEDIATE)
            out[t] += topk[t, k] * (down @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("native", [True, False], ids=["packed", "stacked"])
@pytest.mark.parametrize("token_slots", [[0, -1, 2, 2, 0, -1, 0], [2, 2, 2]], ids=["mixed", "one-slot"])
def test_each_routed_row_takes_its_slots_deltas(native: bool, token_slots: list[int]) -> None:
    torch.manual_seed(0)
    weights = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.3, torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.3)
    mapping = LoRAMapping("cpu")
    experts = experts_of(0, 1, weights, mapping, native)
    held = adapters()
    for slot, parts in held.items():
        experts.lora.set_slot(slot, parts)
    x = torch.randn(len(token_slots), HIDDEN)
    topk, ids = route(torch.randn(len(token_slots), EXPERTS), TOP_K, True)
    slots = np.array(token_slots)
    mapping.set(slots)
    assert experts.lora.active
    torch.testing.assert_close(experts.partial(x, topk, ids), reference(x, weights, ids, topk, slots, held),
                               atol=1e-5, rtol=1e-5)
    mapping.set(np.array([1, -1, 1][:len(token_slots)]))  # slot 1 holds no expert adapter: the plain experts
    assert not experts.lora.active
    torch.testing.assert_close(experts.partial(x, topk, ids), reference(x, weights, ids, topk, slots * 0 - 1, held),
                               atol=1e-5, rtol=1e-5)


def test_two_ranks_shares_sum_to_the_whole() -> None:
    """Rank r holds gate rows, up rows and down columns of its half of the intermediate size, and of each
    adapter's B (gate/up) and A (down): the two partial outputs sum to one rank's."""
    torch.manual_seed(0)
    weights = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.3, torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.3)
    held, slots = adapters(), np.array([0, 2, -1, 2, 0])
    x = torch.randn(len(slots), HIDDEN)
    topk, ids = route(torch.randn(len(slots), EXPERTS), TOP_K, False)
    outputs = []
    for world in (1, 2):
        total = 0
        for rank in range(world):
            mapping = LoRAMapping("cpu")
            experts = experts_of(rank, world, weights, mapping, False)
            for slot, parts in held.items():
                experts.lora.set_slot(slot, parts)
            mapping.set(slots)
            total = total + experts.partial(x, topk, ids)
        outputs.append(total)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs[0], reference(x, weights, ids, topk, slots, held), atol=1e-5, rtol=1e-5)


def test_parts_are_checked_by_name() -> None:
    lora = ExpertShapes(EXPERTS, HIDDEN, INTERMEDIATE, MAX_RANK)
    lora.check("gate_up", torch.zeros(2, HIDDEN), torch.zeros(2 * INTERMEDIATE, 2), "ok")
    with pytest.raises(ValueError, match="m: rank 5 is above max_lora_rank 4"):
        lora.check("down", torch.zeros(5, INTERMEDIATE), torch.zeros(HIDDEN, 5), "m")
    with pytest.raises(ValueError, match=r"m: lora_A \(2, 16\) and lora_B \(16, 2\) do not fit the experts' down "
                                         r"projection \(12 inputs, 16 outputs\)"):
        lora.check("down", torch.zeros(2, HIDDEN), torch.zeros(HIDDEN, 2), "m")
