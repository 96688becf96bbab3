"""MoE experts held as layers of the ``gguf`` quant method (``layers/expert_linears.py``): K-quants and legacy
blocks, gate, up and down of one expert in different types, one and two tensor-parallel ranks, against the
routed sum of each expert's MLP on gguf-py's dequantization of the same blocks.
"""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext, RankInfo
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from pluginfer.layers.moe import FusedExperts
from pluginfer.quant import gguf as gguf_method
from pluginfer.quant.ggml_quantize import quantize
from pluginfer.testing.threads import run_ranks
from tests.layers.conftest import backend_with
from tests.layers.test_moe_tp import build_on

T = gguf.GGMLQuantizationType
HIDDEN = 256
# Each expert's (gate, up, down) types: K-quants (blocks of 256) and legacy ones (32), mixed within an expert.
TYPES = [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q5_1, T.Q4_0), (T.Q6_K, T.Q4_1, T.Q8_0), (T.Q5_0, T.Q5_0, T.Q4_K)]


@pytest.fixture(autouse=True)
def float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float activations against dequantized tiles: the sums of gguf-py's weights, up to their order."""
    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")


def expert_blocks(intermediate: int) -> list[tuple[GGMLTensor, GGMLTensor, GGMLTensor]]:
    generator = torch.Generator().manual_seed(3)
    experts = []
    for types in TYPES:
        shapes = ((intermediate, HIDDEN), (intermediate, HIDDEN), (HIDDEN, intermediate))
        experts.append(tuple(GGMLTensor(quantize(torch.randn(*shape, generator=generator) * 0.1, qtype), qtype,
                                        torch.Size(shape), f"expert.{qtype.name}")
                             for qtype, shape in zip(types, shapes)))
    return experts


def dense(tensor: GGMLTensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(tensor.raw.numpy(), tensor.qtype)).reshape(tensor.shape)


def reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, blocks: list) -> torch.Tensor:
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate, up, down = (dense(t) for t in blocks[ids[token, k]])
            out[token] += weights[token, k] * (F.silu(x[token] @ gate.T) * (x[token] @ up.T)) @ down.T
    return out


def run(collective: object, intermediate: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
        blocks: list) -> torch.Tensor:
    world = collective.world_size
    ctx = BuildContext(backend=backend_with(True), quant=gguf_method.build(), collective=collective,
                       dtype=torch.float32, max_model_len=64,
                       rank=RankInfo(rank=collective.rank, world_size=world, tp_size=world))
    experts = build_on(ctx, lambda: FusedExperts(len(TYPES), HIDDEN, intermediate))
    for expert, (gate, up, down) in enumerate(blocks):
        experts.weight_loader(experts.gate_up_proj, gate, (expert, 0))
        experts.weight_loader(experts.gate_up_proj, up, (expert, 1))
        experts.weight_loader(experts.down_proj, down, (expert, None))
    experts.process_weights_after_loading()
    assert experts.gate_up_proj.numel() == 0  # no stacked float copy
    # the blocks' bytes, this rank's share (gate and up of one type are one group)
    assert experts.resident_bytes == sum(t.raw.numel() for expert in blocks for t in expert) // world
    return experts(x, weights, ids)


@pytest.mark.parametrize("world", [1, 2])
def test_experts_in_blocks_equal_the_dequantized_experts(world: int) -> None:
    intermediate = 256 * world  # each rank's down inputs whole K-quant blocks
    blocks = expert_blocks(intermediate)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(6, HIDDEN, generator=generator)
    ids = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0], [1, 2]])
    weights = torch.rand(6, 2, generator=generator)
    expected = reference(x, weights, ids, blocks)
    if world == 1:
        results = [run(single.build(), intermediate, x, weights, ids, blocks)]
    else:
        results = run_ranks(world, lambda collective: run(collective, intermediate, x, weights, ids, blocks))
    for out in results:
        torch.testing.assert_close(out, expected, atol=2e-4 * expected.abs().max().item(), rtol=0)
