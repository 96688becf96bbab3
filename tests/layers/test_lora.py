"""The batched LoRA block: each token row gets its own adapter's delta, the whole batch in one matmul pair."""

from __future__ import annotations

import numpy as np
import torch

from pluginfer.layers.lora import LoRALayer, LoRAMapping


def test_mixed_slots_match_each_rows_own_adapter() -> None:
    torch.manual_seed(0)
    mapping = LoRAMapping(torch.device("cpu"))
    layer = LoRALayer(input_size=8, output_sizes=[6, 4], max_loras=3, max_rank=4, mapping=mapping,
                      dtype=torch.float64, device=torch.device("cpu"))
    adapters = {}  # slot -> {projection: (A, B)}, scale
    layer.set_slot(1, {0: (torch.randn(3, 8, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64))}, 1.0)
    for slot, (rank, scale) in [(0, (4, 2.0)), (2, (2, 0.5))]:  # slot 1 holds an adapter no row uses
        parts = {0: (torch.randn(rank, 8, dtype=torch.float64), torch.randn(6, rank, dtype=torch.float64))}
        if slot == 0:  # slot 1 adapts only the first projection
            parts[1] = (torch.randn(rank, 8, dtype=torch.float64), torch.randn(4, rank, dtype=torch.float64))
        layer.set_slot(slot, parts, scale)
        adapters[slot] = parts, scale
    x = torch.randn(7, 8, dtype=torch.float64)
    base = torch.randn(7, 10, dtype=torch.float64)
    token_slots = np.array([0, -1, 2, 2, 0, -1, 0])
    mapping.set(token_slots)
    out = layer(x, base.clone())
    for row, slot in enumerate(token_slots):
        want = base[row].clone()
        if slot >= 0:
            parts, scale = adapters[slot]
            for index, (a, b) in parts.items():
                start = [0, 6][index]
                want[start:start + b.shape[0]] += scale * (b @ (a @ x[row]))
        torch.testing.assert_close(out[row], want)
    assert mapping.span == (0, 3) and mapping.whole is None  # slots 0 to 2 in one pass, not per row


def test_one_adapter_for_every_row_and_none() -> None:
    mapping = LoRAMapping(torch.device("cpu"))
    layer = LoRALayer(4, [3], max_loras=1, max_rank=2, mapping=mapping, dtype=torch.float32, device=torch.device("cpu"))
    a, b = torch.randn(2, 4), torch.randn(3, 2)
    layer.set_slot(0, {0: (a, b)}, 1.0)
    x, base = torch.randn(5, 4), torch.zeros(5, 3)
    mapping.set(np.zeros(5, np.int64))
    assert mapping.whole == 0  # the whole batch through one adapter: no mask
    torch.testing.assert_close(layer(x, base.clone()), x @ a.t() @ b.t())
    mapping.clear()
    torch.testing.assert_close(layer(x, base.clone()), base)
    layer.clear_slot(0)
    mapping.set(np.zeros(5, np.int64))
    torch.testing.assert_close(layer(x, base.clone()), base)
