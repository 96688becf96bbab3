"""MoE routers: which experts each token goes to, and with what weights.

Routers (``RouterSpec.topk_method``): ``greedy`` (softmax, top-k: Mixtral, Qwen3-MoE, DeepSeek-V2-Lite),
``group_limited_greedy`` (DeepSeek-V2: softmax, keep the ``topk_group`` groups with the best expert, then
top-k) and ``noaux_tc`` (DeepSeek-V3: sigmoid, a per-expert bias that only steers the choice, groups ranked
by their two best biased scores). ``validate_router_config`` refuses the config fields of routers we lack.
The experts themselves are in ``layers.moe``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# topk_method -> the scoring function it is defined with (DeepSeek's reference code knows no other pairing).
TOPK_METHODS = {"greedy": "softmax", "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}
_GROUPED = ("group_limited_greedy", "noaux_tc")
# Router fields of other MoE families; a pipeline whose router lacks them rejects them.
_ROUTER_FIELDS = ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor",
                  "n_shared_experts")
# Fields of a block beyond routing (Qwen2-MoE's gated shared expert): only its own pipeline takes them.
_UNIMPLEMENTED_FIELDS = ("shared_expert_intermediate_size",)


@dataclass(frozen=True)
class RouterSpec:
    """How a token picks its experts and weighs them.

    ``renormalize``: top-k weights divided by their sum; ``routed_scaling_factor`` multiplies them after.
    ``num_groups`` / ``topk_groups``: experts split into equal groups, only the best groups are eligible.
    ``correction_bias``: the router holds ``e_score_correction_bias`` (added to scores to choose, not to weigh).
    """

    top_k: int
    renormalize: bool = False
    topk_method: str = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False

    @property
    def scoring_func(self) -> str:
        return TOPK_METHODS[self.topk_method]


def validate_router_config(config: dict, num_experts: object, experts_field: str,
                           methods: tuple[str, ...] = (), default_method: str = "greedy") -> None:
    """Expert counts must be positive integers with top-k <= experts; routing modes we lack are errors.

    ``methods``: the topk_methods this pipeline routes with; empty means plain softmax top-k, which
    rejects every other router field (scoring_func, n_group, routed_scaling_factor, shared experts).
    """
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"config.json: {experts_field} must be a positive integer, got {num_experts!r}")
    top_k = config.get("num_experts_per_tok", 2)
    if not isinstance(top_k, int) or not 0 < top_k <= num_experts:
        raise ValueError(f"config.json: num_experts_per_tok must be an integer in [1, {experts_field} "
                         f"{num_experts}], got {top_k!r}")
    for field in _UNIMPLEMENTED_FIELDS + (() if methods else _ROUTER_FIELDS):
        if config.get(field) is not None:
            raise ValueError(f"config.json: router field {field} = {config[field]!r} is not supported "
                             "(only softmax top-k routing without shared experts)")
    if not methods:
        return
    method = config.get("topk_method") or default_method
    if method not in methods:
        raise ValueError(f"config.json: topk_method = {method!r} is not supported by this pipeline "
                         f"(supported: {', '.join(methods)})")
    scoring = config.get("scoring_func") or TOPK_METHODS[method]
    if scoring != TOPK_METHODS[method]:
        raise ValueError(f"config.json: scoring_func = {scoring!r} is not supported with topk_method {method!r} "
                         f"(it scores with {TOPK_METHODS[method]!r})")
    if method in _GROUPED:
        groups, chosen = config.get("n_group"), config.get("topk_group")
        if not isinstance(groups, int) or groups <= 0 or num_experts % groups:
            raise ValueError(f"config.json: n_group = {groups!r} must be a positive integer dividing "
                             f"{experts_field} {num_experts} (topk_method {method!r})")
        if not isinstance(chosen, int) or not 0 < chosen <= groups:
            raise ValueError(f"config.json: topk_group = {chosen!r} must be an integer in [1, n_group {groups}]")
        if method == "noaux_tc" and num_experts // groups < 2:
            raise ValueError(f"config.json: n_group = {groups!r} leaves fewer than 2 experts per group "
                             "(noaux_tc ranks groups by their two best experts)")
    scaling = config.get("routed_scaling_factor", 1.0)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or scaling <= 0:
        raise ValueError(f"config.json: routed_scaling_factor = {scaling!r} must be a positive number")
    shared = config.get("n_shared_experts")
    if shared is not None and (not isinstance(shared, int) or shared < 0):
        raise ValueError(f"config.json: n_shared_experts = {shared!r} must be a non-negative integer")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 weights and ids ``[tokens, top_k]`` of each token's experts: softmax (in float32), then top-k."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _group_mask(scores: torch.Tensor, group_scores: torch.Tensor, topk_groups: int) -> torch.Tensor:
    """True for experts in each token's ``topk_groups`` best groups (``group_scores`` ``[tokens, groups]``)."""
    tokens, groups = group_scores.shape
    chosen = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros(tokens, groups, dtype=torch.bool, device=scores.device).scatter_(1, chosen, True)
    return mask.repeat_interleave(scores.shape[-1] // groups, dim=-1)


def select_experts(router_logits: torch.Tensor, spec: RouterSpec,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 weights and ids ``[tokens, top_k]`` for any router in ``TOPK_METHODS``."""
    logits = router_logits.float()
    tokens, num_experts = logits.shape
    groups = spec.num_groups if spec.topk_method in _GROUPED else 1
    if spec.topk_method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if groups > 1:
            group_scores = choice.view(tokens, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~_group_mask(choice, group_scores, spec.topk_groups), float("-inf"))
        ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        scores = logits.softmax(dim=-1)
        if groups > 1:
            group_scores = scores.view(tokens, groups, -1).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(scores, group_scores, spec.topk_groups), 0.0)
        weights, ids = torch.topk(scores, k=spec.top_k, dim=-1, sorted=spec.topk_method == "greedy")
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # as DeepSeek's reference code
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


class TopKRouter(nn.Module):
    """Router logits ``x W^T`` with W ``[num_experts, hidden]`` kept in float32 (replicated, never quantized).

    float32 even in a bf16 model: a rounding that swaps two close experts is an error of a whole expert.
    ``correction_bias``: also hold DeepSeek-V3's ``e_score_correction_bias`` ``[num_experts]`` (float32).
    """

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if correction_bias else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)
