"""Route checkpoint tensors to parameters: fused projections, tied weights, strict accounting."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# (fused parameter name part, checkpoint name part, shard id) as HF llama-style checkpoints store them.
LLAMA_STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Iterable[tuple[str, str, object]] = LLAMA_STACKED,
    ignore: tuple[str, ...] = ("rotary_emb.inv_freq",),
    optional: tuple[str, ...] = (),
) -> None:
    """Load every tensor into its parameter; unknown tensors and unloaded parameters are errors.

    A layer's quant method processes it (repacks, quantizes) as soon as its last tensor arrived,
    so an in-situ quantized model never holds more than a few float layers at once. Other modules
    with a ``process_weights_after_loading()`` method get it called once everything has loaded.
    ``ignore``: checkpoint names containing one of these are skipped (e.g. cached rope tables).
    ``optional``: parameters that may stay unloaded (e.g. a tied ``lm_head.weight``).
    """
    stacked = tuple(stacked)
    params = dict(model.named_parameters(remove_duplicate=False))
    unloaded = {name for name in params if not any(part in name for part in optional)}
    shards_of = {fused: {s for f, _, s in stacked if f == fused} for fused, _, _ in stacked}
    part_of = {(fused, shard): part for fused, part, shard in stacked}
    pending: dict[str, set] = {}  # fused parameter -> shards not yet seen
    layer_of: dict[str, str] = {}  # parameter -> its quantized layer
    waiting: dict[str, set[str]] = {}  # quantized layer -> parameters still to load
    layers = {name: module for name, module in model.named_modules() if hasattr(module, "quant_method")}
    for name in params:
        owner = name.rpartition(".")[0]
        if owner in layers:
            layer_of[name] = owner
            if name in unloaded:
                waiting.setdefault(owner, set()).add(name)
    for owner in layers.keys() - waiting.keys():  # nothing to load (e.g. all optional)
        waiting[owner] = set()
    for name, tensor in weights:
        if any(part in name for part in ignore):
            continue
        target, shard_id = name, None
        for fused, part, shard in stacked:
            if part in name:
                target, shard_id = name.replace(part, fused), shard
                pending.setdefault(target, set(shards_of[fused])).discard(shard)
                break
        param = params.get(target)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        param.checkpoint_name = name
        try:
            loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)
        except ValueError as exc:
            raise ValueError(f"checkpoint tensor {name!r}: {exc}") from None
        if not pending.get(target):
            unloaded.discard(target)
            owner = layer_of.get(target)
            if owner is not None and owner in waiting:
                waiting[owner].discard(target)
                if not waiting[owner]:
                    del waiting[owner]
                    layers[owner].quant_method.process_weights_after_loading(layers[owner])
    missing = []
    for name in sorted(unloaded):  # name the checkpoint tensors, not our fused parameters
        fused = next((f for f, _, _ in stacked if f in name), None)
        if fused is None:
            missing.append(name)
        else:
            shards = pending.get(name, shards_of[fused])
            missing += sorted(name.replace(fused, part_of[(fused, shard)]) for shard in shards)
    if missing:
        raise KeyError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}")
    for owner in waiting:  # layers whose parameters were all optional
        layers[owner].quant_method.process_weights_after_loading(layers[owner])
    for module in model.modules():
        # other layers that re-lay their weights out (e.g. FusedExperts)
        if not hasattr(module, "quant_method") and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
