"""Sparse mixture-of-experts block: a top-k router and experts held as stacked weights.

Experts live in ``gate_up_proj`` ``[experts, 2 * intermediate, hidden]`` and ``down_proj`` ``[experts, hidden,
intermediate]``, per-expert checkpoint tensors routed in by ``expert_weight_names``; under a quant method that
``holds_experts`` (GGUF blocks) each expert is that method's linears (``layers.expert_linears``). Offloaded
experts wait in host memory and are staged on the device when routed to. Tensor parallelism runs inside the
experts, as vLLM's default: one all-reduce of the routed and shared experts' partial sums.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pluginfer.layers import dense
from pluginfer.layers.activation import gated_activation
from pluginfer.layers.context import backend_op, current_context
from pluginfer.layers.expert_linears import ExpertLinear, expert_linears
from pluginfer.layers.expert_lora import DOWN, GATE_UP, ExpertLoRA
from pluginfer.layers.mlp import check_tp_divisible
from pluginfer.layers.router import RouterSpec, TopKRouter, route, select_experts

logger = logging.getLogger(__name__)


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


# hidden_act -> the activation name of op ``fused_moe`` (``layers/ops.py``); as ``layers.activation``.
_ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                     "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


class _StagingPool:
    """Device buffers an offloaded expert is copied into; one per (shape, dtype), shared by a model's layers."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.buffers = device, {}

    def buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return self.buffers[key]

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers.values())


# id(BuildContext) -> pool; layers built in one context share it
_POOLS: dict[int, _StagingPool] = {}


def _staging_pool(ctx: object, device: torch.device) -> _StagingPool:
    key = id(ctx)
    if key not in _POOLS:
        _POOLS[key] = _StagingPool(device)
        weakref.finalize(ctx, _POOLS.pop, key, None)
    return _POOLS[key]


class FusedExperts(nn.Module):
    """Every expert's gated MLP; each token's output is the router-weighted sum over its top-k experts.

    ``lora`` (None, or a ``layers.expert_lora.ExpertLoRA``): adapters' deltas on the experts; a step whose tokens
    use one runs the experts' loop below (not the backend's ``fused_moe`` op) with the deltas added in it.

    ``num_offloaded`` (default: the build context's ``num_experts_offload_per_rank``): the last experts of the
    layer live in a host store, not in the parameters; a routed one is copied into a staging buffer on the
    compute device for its matmuls (``transfers`` / ``transferred_bytes`` count the copies).

    Tensor parallelism (the context's collective): each rank holds its ``intermediate_size / tp_size`` slice
    of every expert (``shard_size``), offloaded ones included. ``reduce_results``: all-reduce the output; a
    block that adds more partial sums first (shared experts) passes False and reduces once itself.
    ``size_field``: the config field ``intermediate_size`` came from, named when it does not split.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 num_offloaded: int | None = None, reduce_results: bool = True,
                 size_field: str = "intermediate_size") -> None:
        super().__init__()
        ctx = current_context()
        self.collective, self.reduce_results = ctx.collective, reduce_results
        self.tp_rank, self.tp_size = ctx.collective.rank, ctx.collective.world_size
        check_tp_divisible(intermediate_size, size_field)
        self.shard_size = intermediate_size // self.tp_size
        if num_offloaded is None:
            num_offloaded = ctx.num_experts_offload_per_rank
        if not 0 <= num_offloaded <= num_experts:
            raise ValueError(f"cache.num_experts_offload_per_rank: {num_offloaded} is more than the "
                             f"{num_experts} experts of a layer")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        # Each expert's (gate_up, down) as layers of the quant method, when it holds experts in its own format
        # (a plain list: their weights are the method's, reached through the stacked parameters' loader).
        self.linears: list[tuple[ExpertLinear, ExpertLinear]] | None = None
        if getattr(ctx.quant, "holds_experts", False):
            if num_offloaded:
                raise ValueError(f"cache.num_experts_offload_per_rank: experts of quant method {ctx.quant.name!r} "
                                 "stay in the checkpoint's format and cannot be offloaded; set it to 0")
            self.linears = expert_linears(ctx.quant, num_experts, hidden_size, self.shard_size, ctx.dtype,
                                          self.tp_rank, self.tp_size)
        self.num_resident = num_experts - num_offloaded
        gate_up_shape, down_shape = (2 * self.shard_size, hidden_size), (hidden_size, self.shard_size)
        stacked = 0 if self.linears is not None else self.num_resident  # the targets of the loader only
        self.gate_up_proj = nn.Parameter(torch.empty(stacked, *gate_up_shape, dtype=ctx.dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(stacked, *down_shape, dtype=ctx.dtype), requires_grad=False)
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader
        device = torch.empty(0).device  # the device the model is being built on
        pin = device.type == "cuda"  # page-locked host memory lets the copy run asynchronously
        # Plain attributes, not buffers: ``module.to(device)`` must not pull the host store back.
        self.host_gate_up = torch.empty(num_offloaded, *gate_up_shape, dtype=ctx.dtype, device="cpu", pin_memory=pin)
        self.host_down = torch.empty(num_offloaded, *down_shape, dtype=ctx.dtype, device="cpu", pin_memory=pin)
        self.staging = _staging_pool(ctx, device) if num_offloaded else None
        if self.staging is not None:  # allocated now, so the load-time memory report counts them
            self.staging.buffer(gate_up_shape, ctx.dtype), self.staging.buffer(down_shape, ctx.dtype)
        self.transfers, self.transferred_bytes = 0, 0
        self.act_fn = gated_activation(hidden_act)
        self.activation = _ACTIVATION_NAMES.get(hidden_act)  # the name op fused_moe takes
        self.kernel = backend_op(ctx.backend, "fused_moe") \
            if num_offloaded == 0 and self.activation and self.linears is None else None
        self.dense = dense.DenseMatmul.for_context(ctx)
        # a packed layout of layers/dense.py once the experts are packed
        self.layout = "checkpoint"
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # packed copies of resident experts

    lora: ExpertLoRA | None = None

    @property
    def num_offloaded(self) -> int:
        return self.num_experts - self.num_resident

    @property
    def resident_bytes(self) -> int:
        """Bytes of expert weights on the compute device (the shared staging buffers not included)."""
        if self.linears is not None:
            return sum(layer.nbytes for pair in self.linears for layer in pair)
        if self.packed is not None:
            return sum(t.numel() * t.element_size() for pair in self.packed for t in pair)
        return self.gate_up_proj.nbytes + self.down_proj.nbytes

    def process_weights_after_loading(self) -> None:
        """On the CPU, in float32: resident experts move to a packed layout (``layers/dense.py``: the
        native panels, or oneDNN's for an engine that batches; the stacked parameters are emptied,
        so they are held once). Experts held by the quant method are its to process."""
        if self.linears is not None:
            for layer in (layer for pair in self.linears for layer in pair):
                layer.process_weights_after_loading()
            return
        if self.packed is not None or self.kernel is not None:
            return
        layout = self.dense.packed_layout(self.gate_up_proj.data)
        if layout is None:
            return
        self.layout = layout
        self.packed = [(self._pack(self.gate_up_proj.data[e]), self._pack(self.down_proj.data[e]))
                       for e in range(self.num_resident)]
        for param in (self.gate_up_proj, self.down_proj):
            param.data = param.data.new_empty((0, *param.shape[1:]))

    @property
    def offloaded_bytes(self) -> int:
        return self.host_gate_up.nbytes + self.host_down.nbytes

    def _expert_view(self, param: nn.Parameter, expert: int) -> torch.Tensor:
        if expert < self.num_resident:
            return param.data[expert]
        host = self.host_gate_up if param is self.gate_up_proj else self.host_down
        return host[expert - self.num_resident]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """``shard_id`` None: the whole stacked tensor; ``(expert, 0 | 1)``: its gate or up; ``(expert, None)``:
        that expert's whole tensor (gate and up stacked, gate rows first; or down).

        Checkpoint tensors have the full intermediate size; this rank copies its slice.
        """
        name = getattr(param, "checkpoint_name", "weight")
        if self.linears is not None:
            self._load_linear(param, loaded, shard_id, name)
            return
        if shard_id is None:
            expected = (self.num_experts, *self._full_shape(param))
            if tuple(loaded.shape) != expected:
                raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected {expected}")
            for expert in range(self.num_experts):
                self._load_expert(param, expert, None, loaded[expert], name)
            return
        expert, half = shard_id
        self._load_expert(param, expert, half, loaded, name)

    def _load_linear(self, param: nn.Parameter, loaded: object, shard_id: object, name: str) -> None:
        """Hand a checkpoint tensor to the expert layers of the quant method (which check and slice it)."""
        if shard_id is None:  # every expert stacked
            if tuple(loaded.shape) != (self.num_experts, *self._full_shape(param)):
                raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected "
                                 f"{(self.num_experts, *self._full_shape(param))}")
            for expert in range(self.num_experts):
                self._load_linear(param, loaded[expert], (expert, None), name)
            return
        expert, half = shard_id
        gate_up, down = self.linears[expert]
        (gate_up if param is self.gate_up_proj else down).load(loaded, half, name)

    def _full_shape(self, param: nn.Parameter) -> tuple[int, int]:
        """One expert's tensor in the checkpoint (every rank's slices together)."""
        if param is self.gate_up_proj:
            return 2 * self.intermediate_size, self.hidden_size
        return self.hidden_size, self.intermediate_size

    def _load_expert(self, param: nn.Parameter, expert: int, half: int | None, loaded: torch.Tensor,
                     name: str) -> None:
        """Copy this rank's slice of one expert's gate (``half`` 0), up (1), gate and up (None) or down weight."""
        if param is self.gate_up_proj and half is None:
            if tuple(loaded.shape) != self._full_shape(param):
                raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected "
                                 f"{self._full_shape(param)}")
            if self.tp_size == 1:  # the rank's slice is the whole tensor: one copy
                self._expert_view(param, expert).copy_(loaded)
                return
            for index, part in enumerate(loaded.split(self.intermediate_size)):
                self._load_expert(param, expert, index, part, name)
            return
        target = self._expert_view(param, expert)
        # down's inputs, gate's and up's outputs are the intermediate axis
        axis = 1 if half is None else 0
        if half is not None:
            target = target.narrow(0, half * self.shard_size, self.shard_size)
        full = list(target.shape)
        full[axis] = self.intermediate_size
        if list(loaded.shape) != full:
            raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected {tuple(full)}")
        if self.tp_size > 1:
            loaded = loaded.narrow(axis, self.tp_rank * self.shard_size, self.shard_size)
        target.copy_(loaded)

    def _weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This expert's (gate_up, down) on the compute device, copied from the host store if offloaded.

        In the resident experts' packed layout when they are packed: an offloaded expert is then
        packed straight from the host store (the copy the staging buffer would take), so both
        kinds of expert run the same kernel and offloading never changes a result.
        """
        if expert < self.num_resident:
            if self.packed is not None:
                return self.packed[expert]
            return self.gate_up_proj[expert], self.down_proj[expert]
        index = expert - self.num_resident
        if self.packed is not None:
            gate_up, down = self._pack(self.host_gate_up[index]), self._pack(self.host_down[index])
        else:
            gate_up = self.staging.buffer(self.host_gate_up.shape[1:], self.host_gate_up.dtype)
            down = self.staging.buffer(self.host_down.shape[1:], self.host_down.dtype)  # the pool reuses these
            gate_up.copy_(self.host_gate_up[index], non_blocking=True)
            down.copy_(self.host_down[index], non_blocking=True)
        self.transfers += 1
        self.transferred_bytes += self.host_gate_up[index].nbytes + self.host_down[index].nbytes
        return gate_up, down

    def _projections(self, expert: int) -> tuple[Callable, Callable]:
        """This expert's gate/up and down projections, as the quant method's layers or on its stacked weights."""
        if self.linears is not None:
            return self.linears[expert]
        gate_up, down = self._weights(expert)
        return (lambda x: self.dense.linear(self.layout, x, gate_up, None, 2 * self.shard_size),
                lambda x: self.dense.linear(self.layout, x, down, None, self.hidden_size))

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return self.dense.pack(self.layout, weight)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = self.partial(hidden, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = self.collective.all_reduce(out)
        return out

    def partial(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (the whole output on one rank): its slice of every expert."""
        lora = self.lora if self.lora is not None and self.lora.active else None
        if self.kernel is not None and lora is None:
            out = self.kernel(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation)
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
            x = routed[rows]
            gate_up_of, down_of = self._projections(expert)
            gate_up = gate_up_of(x)
            if lora is not None:
                lora.add(GATE_UP, expert, x, gate_up, tokens[rows])
            activated = self.act_fn(gate_up)
            down = down_of(activated)
            if lora is not None:
                lora.add(DOWN, expert, activated, down, tokens[rows])
            outputs[rows] = down
            start += count
        weighted = outputs.float() * topk_weights.flatten()[order, None]
        # Back to (token, k) order, then each token's sum over its k experts. (index_add_ into the
        # tokens is far slower on the CPU: up to tens of ms per layer with repeated indices.)
        unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return unsorted.view(-1, top_k, hidden.shape[-1]).sum(dim=1).to(hidden.dtype)


class SparseMoeBlock(nn.Module):
    """``gate`` (router), ``experts`` and optional ``shared_experts``, named as MoE checkpoints name them.

    ``renormalize``: rescale the top-k weights to sum to one (Mixtral always; Qwen3-MoE's ``norm_topk_prob``).
    ``router``: a full RouterSpec (grouped, sigmoid, scaled routers); it overrides ``top_k`` / ``renormalize``.
    ``shared_experts``: a dense MLP every token also runs through (DeepSeek), added to the routed output.
    ``size_field``: the config field of ``intermediate_size`` (named when it does not split across ranks).

    Under tensor parallelism the router is replicated (every rank picks the same experts), each rank runs
    its slice of the experts and of a ``GatedMLP`` shared expert, and one all-reduce sums both.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, hidden_act: str = "silu", router: RouterSpec | None = None,
                 shared_experts: nn.Module | None = None, size_field: str = "intermediate_size") -> None:
        super().__init__()
        router = router or RouterSpec(top_k, renormalize)
        if not 0 < router.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {router.top_k} must be between 1 and num_experts {num_experts}")
        self.top_k, self.renormalize, self.router = router.top_k, router.renormalize, router
        self.gate = TopKRouter(num_experts, hidden_size, router.correction_bias)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, hidden_act, reduce_results=False,
                                    size_field=size_field)
        self.shared_experts = shared_experts
        self.collective = self.experts.collective

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.gate(hidden)
        if self.router.topk_method == "greedy" and self.router.routed_scaling_factor == 1.0:
            weights, ids = route(logits, self.top_k, self.renormalize)
        else:
            weights, ids = select_experts(logits, self.router, self.gate.e_score_correction_bias)
        out = self.experts(hidden, weights, ids)
        if self.experts.tp_size == 1:
            return out if self.shared_experts is None else out + self.shared_experts(hidden)
        partial = getattr(self.shared_experts, "forward_partial", None)
        if partial is not None:  # one all-reduce for the routed and the shared experts
            out = out + partial(hidden)
        out = self.collective.all_reduce(out)
        if self.shared_experts is not None and partial is None:  # a shared block that reduces itself
            out = out + self.shared_experts(hidden)
        return out


@dataclass(frozen=True)
class ExpertMemory:
    """Expert weight bytes of a model: on the compute device, in the host store, and the staging buffers."""

    resident_bytes: int
    offloaded_bytes: int
    staging_bytes: int
    offloaded_experts: int


def expert_memory(model: nn.Module) -> ExpertMemory:
    layers = [m for m in model.modules() if isinstance(m, FusedExperts)]
    pools = {id(layer.staging): layer.staging for layer in layers if layer.staging is not None}
    return ExpertMemory(sum(layer.resident_bytes for layer in layers), sum(layer.offloaded_bytes for layer in layers),
                        sum(pool.nbytes for pool in pools.values()), sum(layer.num_offloaded for layer in layers))


def expert_transfers(model: nn.Module) -> int:
    """Offloaded experts copied to the compute device so far, over all layers."""
    return sum(m.transfers for m in model.modules() if isinstance(m, FusedExperts))
