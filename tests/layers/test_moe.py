"""The fused MoE block against a dense float64 reference: every token through its top-k experts, one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import backend as cpu
from pluginfer.layers.context import building
from pluginfer.layers.moe import SparseMoeBlock, expert_weight_names
from pluginfer.layers.weights import load_named_weights
from tests.layers.conftest import backend_with, make_context

HIDDEN, INTERMEDIATE = 64, 48


def per_expert_weights(num_experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF Mixtral-style tensors: ``gate.weight`` and ``experts.{e}.w1/w3/w2.weight``."""
    generator = torch.Generator().manual_seed(seed)
    weights = {"moe.gate.weight": torch.randn(num_experts, HIDDEN, generator=generator)}
    for e in range(num_experts):
        weights[f"moe.experts.{e}.w1.weight"] = torch.randn(INTERMEDIATE, HIDDEN, generator=generator) * 0.2
        weights[f"moe.experts.{e}.w3.weight"] = torch.randn(INTERMEDIATE, HIDDEN, generator=generator) * 0.2
        weights[f"moe.experts.{e}.w2.weight"] = torch.randn(HIDDEN, INTERMEDIATE, generator=generator) * 0.2
    return weights


def reference(x: torch.Tensor, weights: dict[str, torch.Tensor], top_k: int, renormalize: bool) -> torch.Tensor:
    x = x.double()
    probs = torch.softmax(x @ weights["moe.gate.weight"].double().T, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top, ids = torch.topk(probs[t], top_k)
        if renormalize:
            top = top / top.sum()
        for weight, e in zip(top.tolist(), ids.tolist()):
            w1, w3, w2 = (weights[f"moe.experts.{e}.{n}.weight"].double() for n in ("w1", "w3", "w2"))
            out[t] += weight * (w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
    return out


class Holder(torch.nn.Module):
    def __init__(self, block: SparseMoeBlock) -> None:
        super().__init__()
        self.moe = block


def build(num_experts: int, top_k: int, renormalize: bool, weights: dict[str, torch.Tensor],
          max_num_seqs: int = 1, dtype: torch.dtype = torch.float32, native_kernels: bool = True) -> Holder:
    ctx = make_context(backend_with(native_kernels), dtype)  # no native kernels (and one sequence): stay stacked
    ctx.max_num_seqs = max_num_seqs  # > 1: oneDNN's packed layout where the native panels are unavailable
    with building(ctx):
        model = Holder(SparseMoeBlock(num_experts, top_k, HIDDEN, INTERMEDIATE, renormalize))
    load_named_weights(model, weights.items(), stacked=expert_weight_names(num_experts, "w1", "w3", "w2"))
    return model


@pytest.mark.parametrize("num_experts,top_k,renormalize", [(8, 2, True), (8, 2, False), (4, 1, False),
                                                           (6, 3, True)])
@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_matches_dense_reference(num_experts: int, top_k: int, renormalize: bool, tokens: int,
                                 max_num_seqs: int) -> None:
    weights = per_expert_weights(num_experts)
    model = build(num_experts, top_k, renormalize, weights, max_num_seqs)
    experts = model.moe.experts
    expected = experts.dense.packed_layout(torch.empty(1, 1))
    assert experts.layout == (expected or "checkpoint") and (experts.packed is not None) == (expected is not None)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    out = model.moe(x)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), reference(x, weights, top_k, renormalize), atol=1e-5, rtol=1e-5)


def test_idle_experts_are_skipped() -> None:
    """A router that sends every token to experts 0 and 1 leaves the others idle (and their weights unread)."""
    weights = per_expert_weights(4)
    weights["moe.gate.weight"] = torch.zeros(4, HIDDEN)
    weights["moe.gate.weight"][:2, 0] = torch.tensor([5.0, 4.0])
    model = build(4, 2, True, weights, native_kernels=False)
    assert model.moe.experts.packed is None
    model.moe.experts.gate_up_proj.data[2:] = float("nan")
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2)).abs()
    assert torch.allclose(model.moe(x).double(), reference(x, weights, 2, True), atol=1e-5, rtol=1e-5)


def test_bfloat16_stays_close_to_reference() -> None:
    weights = per_expert_weights(8)
    model = build(8, 2, True, weights, dtype=torch.bfloat16)
    assert model.moe.experts.packed is None  # the packed layouts are float32 only
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = model.moe(x)
    expected = reference(x.float(), weights, 2, True)
    assert out.dtype == torch.bfloat16
    assert (out.double() - expected).abs().max() < 0.05 * expected.abs().max()


def test_stacked_layout_is_gate_then_up() -> None:
    weights = per_expert_weights(4)
    model = build(4, 2, True, weights, native_kernels=False)
    stacked = model.moe.experts.gate_up_proj
    assert torch.equal(stacked[3, :INTERMEDIATE], weights["moe.experts.3.w1.weight"])
    assert torch.equal(stacked[3, INTERMEDIATE:], weights["moe.experts.3.w3.weight"])
    assert torch.equal(model.moe.experts.down_proj[3], weights["moe.experts.3.w2.weight"])


def test_missing_expert_tensor_is_named() -> None:
    weights = per_expert_weights(4)
    del weights["moe.experts.2.w3.weight"]
    with pytest.raises(KeyError, match=r"moe\.experts\.2\.w3\.weight"):
        build(4, 2, True, weights)


def test_wrong_expert_shape_is_named() -> None:
    weights = per_expert_weights(4)
    weights["moe.experts.1.w2.weight"] = torch.zeros(HIDDEN, INTERMEDIATE + 1)
    with pytest.raises(ValueError, match=r"moe\.experts\.1\.w2\.weight.*\(64, 49\)"):
        build(4, 2, True, weights)


def test_top_k_above_experts_is_an_error() -> None:
    with building(make_context(cpu.build())), pytest.raises(ValueError, match="num_experts_per_tok 5"):
        SparseMoeBlock(4, 5, HIDDEN, INTERMEDIATE, renormalize=True)
