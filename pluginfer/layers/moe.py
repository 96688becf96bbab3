"""Sparse mixture-of-experts block: a softmax top-k router and experts held as stacked weights.

Experts live in two tensors, ``gate_up_proj`` ``[num_experts, 2 * intermediate, hidden]`` (gate rows first)
and ``down_proj`` ``[num_experts, hidden, intermediate]``; checkpoints that store one tensor per expert
are routed into them by ``expert_weight_names`` and the parameters' ``weight_loader``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.layers.activation import gated_activation
from pluginfer.layers.context import backend_op, current_context


def expert_weight_names(num_experts: int, gate: str, up: str, down: str) -> tuple[tuple[str, str, object], ...]:
    """``load_named_weights`` entries sending ``experts.{e}.{gate,up,down}.weight`` to the stacked parameters.

    E.g. Mixtral: ``expert_weight_names(n, "w1", "w3", "w2")``; Qwen3-MoE: ``("gate_proj", "up_proj", "down_proj")``.
    """
    names: list[tuple[str, str, object]] = []
    for expert in range(num_experts):
        names += [(".experts.gate_up_proj", f".experts.{expert}.{gate}.weight", (expert, 0)),
                  (".experts.gate_up_proj", f".experts.{expert}.{up}.weight", (expert, 1)),
                  (".experts.down_proj", f".experts.{expert}.{down}.weight", (expert, None))]
    return tuple(names)


def validate_router_config(config: dict, num_experts: object, experts_field: str) -> None:
    """Expert counts must be positive integers with top-k <= experts; routing modes we lack are errors."""
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"config.json: {experts_field} must be a positive integer, got {num_experts!r}")
    top_k = config.get("num_experts_per_tok", 2)
    if not isinstance(top_k, int) or not 0 < top_k <= num_experts:
        raise ValueError(f"config.json: num_experts_per_tok must be an integer in [1, {experts_field} "
                         f"{num_experts}], got {top_k!r}")
    # Fields of other MoE routers (grouped top-k, sigmoid scoring, routed scaling, shared experts).
    for field in ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor",
                  "n_shared_experts", "shared_expert_intermediate_size"):
        if config.get(field) is not None:
            raise ValueError(f"config.json: router field {field} = {config[field]!r} is not supported "
                             "(only softmax top-k routing without shared experts)")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 weights and ids ``[tokens, top_k]`` of each token's experts: softmax (in float32), then top-k."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedExperts(nn.Module):
    """Every expert's gated MLP; each token's output is the router-weighted sum over its top-k experts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        ctx = current_context()
        if ctx.collective.world_size > 1:
            raise ValueError("mixture-of-experts layers do not support tensor parallelism yet "
                             f"(tensor-parallel size {ctx.collective.world_size})")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                     dtype=ctx.dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=ctx.dtype),
                                      requires_grad=False)
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader
        self.act_fn = gated_activation(hidden_act)
        self.kernel = backend_op(ctx.backend, "fused_moe")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """``shard_id`` None: the whole stacked tensor; ``(expert, 0 | 1)``: its gate or up; ``(expert, None)``: down."""
        name = getattr(param, "checkpoint_name", "weight")
        target = param.data
        if shard_id is not None:
            expert, half = shard_id
            target = target[expert]
            if half is not None:
                target = target.narrow(0, half * self.intermediate_size, self.intermediate_size)
        if target.shape != loaded.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected "
                             f"{tuple(target.shape)}")
        target.copy_(loaded)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            out = self.kernel(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
            if out is not None:
                return out
        # Sort the (token, expert) pairs by expert so each active expert runs one matmul over its tokens.
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()
        order = flat_ids.argsort(stable=True)
        tokens = order // top_k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        routed = hidden[tokens]
        outputs = torch.empty_like(routed)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate_up = F.linear(routed[rows], self.gate_up_proj[expert])
            outputs[rows] = F.linear(self.act_fn(gate_up), self.down_proj[expert])
            start += count
        weighted = outputs.float() * topk_weights.flatten()[order, None]
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        return out.index_add_(0, tokens, weighted).to(hidden.dtype)


class TopKRouter(nn.Module):
    """Router logits ``x W^T`` with W ``[num_experts, hidden]`` kept in float32 (replicated, never quantized).

    float32 even in a bf16 model: a rounding that swaps two close experts is an error of a whole expert.
    """

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


class SparseMoeBlock(nn.Module):
    """``gate`` (router) and ``experts``, named as Mixtral and Qwen3-MoE checkpoints name them.

    ``renormalize``: rescale the top-k weights to sum to one (Mixtral always; Qwen3-MoE's ``norm_topk_prob``).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, hidden_act: str = "silu") -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = TopKRouter(num_experts, hidden_size)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(hidden), self.top_k, self.renormalize)
        return self.experts(hidden, weights, ids)
