"""The batched LoRA block: each token row gets its own adapter's delta, the whole batch in one matmul pair."""

from __future__ import annotations

import numpy as np
import torch

from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.lora import LoRALayer, LoRAMapping


def test_mixed_slots_match_each_rows_own_adapter() -> None:
    torch.manual_seed(0)
    mapping = LoRAMapping(torch.device("cpu"))
    layer = LoRALayer(input_size=8, shard=ShardSpec(output_sizes=(6, 4)), max_loras=3, max_rank=4, mapping=mapping,
                      dtype=torch.float64, device=torch.device("cpu"))
    adapters = {}  # slot -> {projection: (A, B, scale)}
    layer.set_slot(1, {0: (torch.randn(3, 8, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64), 1.0)})
    for slot, (rank, scale) in [(0, (4, 2.0)), (2, (2, 0.5))]:  # slot 1 holds an adapter no row uses
        parts = {0: (torch.randn(rank, 8, dtype=torch.float64), torch.randn(6, rank, dtype=torch.float64), scale)}
        if slot == 0:  # slot 2 adapts only the first projection; slot 0's second has a scale of its own
            parts[1] = (torch.randn(rank, 8, dtype=torch.float64), torch.randn(4, rank, dtype=torch.float64), 3.0)
        layer.set_slot(slot, parts)
        adapters[slot] = parts
    x = torch.randn(7, 8, dtype=torch.float64)
    base = torch.randn(7, 10, dtype=torch.float64)
    token_slots = np.array([0, -1, 2, 2, 0, -1, 0])
    mapping.set(token_slots)
    out = layer(x, base.clone())
    for row, slot in enumerate(token_slots):
        want = base[row].clone()
        if slot >= 0:
            for index, (a, b, scale) in adapters[slot].items():
                start = [0, 6][index]
                want[start:start + b.shape[0]] += scale * (b @ (a @ x[row]))
        torch.testing.assert_close(out[row], want)
    assert mapping.span == (0, 3) and mapping.whole is None  # slots 0 to 2 in one pass, not per row


def test_one_adapter_for_every_row_and_none() -> None:
    mapping = LoRAMapping(torch.device("cpu"))
    layer = LoRALayer(4, ShardSpec(output_sizes=(3,)), max_loras=1, max_rank=2, mapping=mapping, dtype=torch.float32, device=torch.device("cpu"))
    a, b = torch.randn(2, 4), torch.randn(3, 2)
    layer.set_slot(0, {0: (a, b, 1.0)})
    x, base = torch.randn(5, 4), torch.zeros(5, 3)
    mapping.set(np.zeros(5, np.int64))
    assert mapping.whole == 0  # the whole batch through one adapter: no mask
    torch.testing.assert_close(layer(x, base.clone()), x @ a.t() @ b.t())
    mapping.clear()
    torch.testing.assert_close(layer(x, base.clone()), base)
    layer.clear_slot(0)
    mapping.set(np.zeros(5, np.int64))
    torch.testing.assert_close(layer(x, base.clone()), base)


def test_tensor_parallel_shards_add_up_to_the_whole_delta() -> None:
    """Two ranks' slots of one adapter: a column-parallel layer's outputs (B split by rows, per projection, KV
    rows shared as the layer shares them) concatenate to the whole delta; a row-parallel layer's partial deltas
    (A split by inputs) sum to it, as its all-reduce sums them."""
    torch.manual_seed(1)
    cpu = torch.device("cpu")
    x = torch.randn(5, 8, dtype=torch.float64)
    token_slots = np.array([0, 0, -1, 0, 0])
    mask = torch.from_numpy(token_slots >= 0).to(torch.float64)[:, None]
    # column parallel: q (8 outputs) split by ranks, k (2 outputs) replicated by both (kv_replicas 2)
    a_q, b_q = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    a_k, b_k = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    whole = torch.cat([x @ a_q.t() @ b_q.t(), x @ a_k.t() @ b_k.t()], dim=1) * 0.5 * mask
    outputs = []
    for rank in range(2):
        mapping = LoRAMapping(cpu)
        shard = ShardSpec(dim=0, rank=rank, size=2, output_sizes=(8, 2), kv_replicas=2)
        layer = LoRALayer(8, shard, max_loras=1, max_rank=4, mapping=mapping, dtype=torch.float64, device=cpu)
        layer.set_slot(0, {0: (a_q, b_q, 0.5), 1: (a_k, b_k, 0.5)})
        mapping.set(token_slots)
        outputs.append(layer(x, torch.zeros(5, 6, dtype=torch.float64)))
    torch.testing.assert_close(torch.cat([outputs[0][:, :4], outputs[1][:, :4]], dim=1), whole[:, :8])
    for out in outputs:
        torch.testing.assert_close(out[:, 4:], whole[:, 8:])
    # row parallel: each rank sees its half of the inputs
    a, b = torch.randn(3, 8, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    partial = []
    for rank in range(2):
        mapping = LoRAMapping(cpu)
        shard = ShardSpec(dim=1, rank=rank, size=2, output_sizes=(6,))
        layer = LoRALayer(4, shard, max_loras=1, max_rank=4, mapping=mapping, dtype=torch.float64, device=cpu)
        layer.set_slot(0, {0: (a, b, 2.0)})
        mapping.set(token_slots)
        partial.append(layer(x[:, 4 * rank:4 * rank + 4], torch.zeros(5, 6, dtype=torch.float64)))
    torch.testing.assert_close(partial[0] + partial[1], x @ a.t() @ b.t() * 2.0 * mask)
