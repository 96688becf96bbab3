"""DeepSeek routers against a per-token definition and against transformers' own router modules."""

from __future__ import annotations

import math

import pytest
import torch

from pluginfer.layers.router import RouterSpec, select_experts, validate_router_config

HIDDEN = 32


def reference(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> list[dict[int, float]]:
    """Each token's {expert: weight}, computed one token at a time from the routers' written definitions."""
    result = []
    per_group = logits.shape[1] // spec.num_groups
    for row in logits.double():
        if spec.topk_method == "noaux_tc":
            scores = [1 / (1 + math.exp(-v)) for v in row.tolist()]
            choice = [s + (0.0 if bias is None else float(b)) for s, b in zip(scores, bias if bias is not None
                                                                                 else [0] * len(scores))]
            group_rank = [sum(sorted(choice[g * per_group:(g + 1) * per_group])[-2:]) for g in range(spec.num_groups)]
        else:
            total = sum(math.exp(v) for v in row.tolist())
            scores = [math.exp(v) / total for v in row.tolist()]
            choice = list(scores)
            group_rank = [max(choice[g * per_group:(g + 1) * per_group]) for g in range(spec.num_groups)]
        if spec.topk_method != "greedy":
            groups = sorted(range(spec.num_groups), key=lambda g: -group_rank[g])[:spec.topk_groups]
            eligible = [e for e in range(len(scores)) if e // per_group in groups]
        else:
            eligible = list(range(len(scores)))
        chosen = sorted(eligible, key=lambda e: -choice[e])[:spec.top_k]
        weights = {e: scores[e] for e in chosen}
        if spec.renormalize:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
        result.append({e: w * spec.routed_scaling_factor for e, w in weights.items()})
    return result


def as_dicts(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist())) for w, i in zip(weights, ids)]


def assert_same_routing(ours: list[dict[int, float]], theirs: list[dict[int, float]]) -> None:
    for token, (a, b) in enumerate(zip(ours, theirs)):
        assert set(a) == set(b), (token, a, b)
        for expert in a:
            assert a[expert] == pytest.approx(b[expert], rel=1e-5, abs=1e-7), (token, expert)


SPECS = {
    "v2-lite-greedy-scaled": RouterSpec(top_k=3, topk_method="greedy", routed_scaling_factor=1.5),
    "v2-group-limited": RouterSpec(top_k=2, topk_method="group_limited_greedy", num_groups=4, topk_groups=2,
                                   routed_scaling_factor=16.0),
    "v2-group-limited-normalized": RouterSpec(top_k=3, renormalize=True, topk_method="group_limited_greedy",
                                              num_groups=4, topk_groups=1),
    "v3-noaux-tc": RouterSpec(top_k=4, renormalize=True, topk_method="noaux_tc", num_groups=4, topk_groups=2,
                              routed_scaling_factor=2.5, correction_bias=True),
    "v3-noaux-tc-one-group-unnormalized": RouterSpec(top_k=2, topk_method="noaux_tc", num_groups=1, topk_groups=1,
                                                     correction_bias=True),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_router_matches_per_token_definition(name: str) -> None:
    spec = SPECS[name]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 16, generator=generator) * 2
    bias = torch.randn(16, generator=generator) * 0.5 if spec.correction_bias else None
    weights, ids = select_experts(logits, spec, bias)
    assert weights.dtype == torch.float32 and ids.shape == (40, spec.top_k)
    assert_same_routing(as_dicts(weights, ids), reference(logits, spec, bias))


def test_correction_bias_chooses_but_does_not_weigh() -> None:
    """A large bias on expert 5 puts it in every token's top-k; its weight stays its sigmoid score."""
    spec = SPECS["v3-noaux-tc-one-group-unnormalized"]
    logits = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(16)
    bias[5] = 100.0
    weights, ids = select_experts(logits, spec, bias)
    assert (ids == 5).any(dim=1).all()
    chosen = weights[ids == 5]
    assert torch.allclose(chosen, logits[:, 5].sigmoid())


def _hf_config(arch: str, **fields):  # a transformers config
    import transformers

    return getattr(transformers, arch).config_class(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, **fields)


HF_CASES = {
    "v2-greedy": ("DeepseekV2ForCausalLM", "DeepseekV2TopkRouter",
                  dict(num_experts_per_tok=3, topk_method="greedy", routed_scaling_factor=1.5)),
    "v2-group-limited": ("DeepseekV2ForCausalLM", "DeepseekV2TopkRouter",
                         dict(num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=16.0)),
    "v3-noaux-tc": ("DeepseekV3ForCausalLM", "DeepseekV3TopkRouter",
                    dict(num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5)),
    "v3-noaux-tc-unnormalized": ("DeepseekV3ForCausalLM", "DeepseekV3TopkRouter",
                                 dict(num_experts_per_tok=2, n_group=8, topk_group=3, norm_topk_prob=False,
                                      routed_scaling_factor=1.0)),
}


def _spec_from_config(arch: str, config: dict) -> RouterSpec:
    """As pluginfer.models.deepseek reads the router (V2 in transformers never renormalizes)."""
    v3 = arch.startswith("DeepseekV3")
    return RouterSpec(top_k=config["num_experts_per_tok"], renormalize=v3 and config["norm_topk_prob"],
                      topk_method="noaux_tc" if v3 else config["topk_method"],
                      num_groups=config.get("n_group") or 1, topk_groups=config.get("topk_group") or 1,
                      routed_scaling_factor=config["routed_scaling_factor"], correction_bias=v3)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_router_matches_transformers_module(case: str) -> None:
    import importlib

    arch, router_class, fields = HF_CASES[case]
    module = importlib.import_module(f"transformers.models.{'deepseek_v3' if 'V3' in arch else 'deepseek_v2'}."
                                     f"modeling_{'deepseek_v3' if 'V3' in arch else 'deepseek_v2'}")
    config = _hf_config(arch, **fields)
    torch.manual_seed(0)
    router = getattr(module, router_class)(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0, 0.3)
    hidden = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    spec = _spec_from_config(arch, config.to_dict())
    bias = getattr(router, "e_score_correction_bias", None)
    weights, ids = select_experts(hidden @ router.weight.T, spec, bias)
    assert_same_routing(as_dicts(weights, ids), as_dicts(hf_weights, hf_ids))


@pytest.mark.parametrize("changes,pattern", [
    ({"topk_method": "noaux_tc", "scoring_func": "softmax"}, r"scoring_func = 'softmax'"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, r"n_group = 3"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 5}, r"topk_group = 5"),
    ({"topk_method": "random"}, r"topk_method = 'random'"),
    ({"routed_scaling_factor": -1.0}, r"routed_scaling_factor = -1\.0"),
    ({"shared_expert_intermediate_size": 64}, r"shared_expert_intermediate_size = 64"),
])
def test_router_fields_nothing_implements_are_rejected(changes: dict, pattern: str) -> None:
    config = {"num_experts_per_tok": 2, **changes}
    with pytest.raises(ValueError, match=pattern):
        validate_router_config(config, 16, "n_routed_experts", methods=("greedy", "group_limited_greedy",
                                                                       "noaux_tc"))


def test_plain_router_rejects_deepseek_fields() -> None:
    with pytest.raises(ValueError, match=r"n_shared_experts = 2"):
        validate_router_config({"n_shared_experts": 2}, 8, "num_experts")


@pytest.mark.parametrize("case", ["v2-group-limited", "v3-noaux-tc"])
def test_moe_block_with_shared_experts_matches_transformers(case: str) -> None:
    """Our SparseMoeBlock loaded from the state dict of transformers' DeepseekV2Moe / DeepseekV3MoE."""
    import importlib

    from pluginfer.backends.cpu import backend as cpu
    from pluginfer.layers.context import building
    from pluginfer.layers.mlp import GatedMLP
    from pluginfer.layers.moe import SparseMoeBlock
    from pluginfer.layers.weights import load_named_weights
    from tests.layers.conftest import make_context

    arch, _, fields = HF_CASES[case]
    v3 = "V3" in arch
    package = "deepseek_v3" if v3 else "deepseek_v2"
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    config = _hf_config(arch, n_shared_experts=2, **fields)
    torch.manual_seed(0)
    theirs = getattr(module, "DeepseekV3MoE" if v3 else "DeepseekV2Moe")(config).eval()
    with torch.no_grad():
        for name, tensor in [*theirs.named_parameters(), *theirs.named_buffers()]:
            tensor.normal_(0, 0.1 if "bias" in name else 0.3)
    with building(make_context(cpu.build())):
        holder = torch.nn.Module()
        holder.mlp = SparseMoeBlock(16, config.num_experts_per_tok, HIDDEN, 16, renormalize=False,
                                    router=_spec_from_config(arch, config.to_dict()),
                                    shared_experts=GatedMLP(HIDDEN, 2 * 16))
    state = {f"mlp.{name}": tensor for name, tensor in theirs.state_dict().items()}
    load_named_weights(holder, state.items())  # experts arrive stacked, shared experts as gate/up/down
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = theirs(hidden.unsqueeze(0))[0]
    torch.testing.assert_close(holder.mlp(hidden), expected, atol=1e-5, rtol=1e-5)


def test_deepseek_v2_norm_topk_prob_follows_deepseek_code() -> None:
    """DeepSeek-V2's modeling code normalizes or scales, never both; transformers' V2 ignores norm_topk_prob.

    Every released V2 checkpoint has norm_topk_prob false, where the three agree (see models/deepseek.py).
    """
    from pluginfer.models.deepseek import router_spec

    base = {"architectures": ["DeepseekV2ForCausalLM"], "num_experts_per_tok": 2, "topk_method": "greedy",
            "routed_scaling_factor": 16.0}
    assert router_spec({**base, "norm_topk_prob": False}) == RouterSpec(2, False, "greedy", 1, 1, 16.0, False)
    assert router_spec({**base, "norm_topk_prob": True}) == RouterSpec(2, True, "greedy", 1, 1, 1.0, False)
    v3 = {**base, "architectures": ["DeepseekV3ForCausalLM"], "topk_method": "noaux_tc", "n_group": 4,
          "topk_group": 2, "norm_topk_prob": True}
    assert router_spec(v3) == RouterSpec(2, True, "noaux_tc", 4, 2, 16.0, True)
