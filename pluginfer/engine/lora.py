"""LoRA adapters in PEFT's format: the request that names one, reading it, and a model's adapter slots.

An adapter is a directory with ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ``target_parameters``, ``rank_pattern``, ``alpha_pattern``) and ``adapter_model.safetensors``
(``...<module>.lora_A.weight [r, in]`` and ``...<module>.lora_B.weight [out, r]``). Its modules are mapped onto the model's linear layers by the
model's weight routes (``q_proj`` -> projection ``q`` of ``qkv_proj``), as its checkpoint's tensors are.

A mixture-of-experts layer's routed experts take adapters in either of PEFT's forms: ``target_parameters`` on
the fused expert tensors (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``;
A ``[r * E, in]``, B ``[out, r * E]``, saved as ``experts.lora_A`` and, a second parameter wrapping the first,
``experts.base_layer.lora_A``: which tensor each pair adapts is told by its shapes), or per-expert linears
(``experts.3.w1``, named as the checkpoint's experts are).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pluginfer.engine.lora_request import LoRARequest
from pluginfer.layers.expert_lora import PARTS, ExpertLoRA, ExpertShapes
from pluginfer.layers.lora import LoRALayer, LoRAMapping
from pluginfer.layers.moe import FusedExperts

_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_PREFIX = "base_model.model."
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save"}
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # the fused expert tensors target_parameters may name
# an adapter module on routed experts: a fused tensor's wrapper(s), or one expert's linear
_EXPERTS = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\..*\bexperts(?:\.(?P<expert>\d+)\.(?P<proj>\w+)|"
                      r"(?:\.base_layer)*)$")


@dataclass
class Adapter:
    """A read adapter: (A, B) by PEFT module name, and each module's rank and scale (alpha / r, or alpha /
    sqrt(r) with rsLoRA), ``r`` and ``lora_alpha`` unless ``rank_pattern`` / ``alpha_pattern`` name the module."""

    name: str
    rank: int
    alpha: float
    rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def rank_of(self, key: str) -> int:
        """The rank of the module ``key`` (a module's name in the model, a fused expert tensor's with it)."""
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.rank)

    def scale_of(self, key: str) -> float:
        rank, alpha = self.rank_of(key), self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.alpha)
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


def _pattern_key(patterns: dict[str, Any], key: str) -> str | None:
    """The first pattern naming the module ``key``: the pattern is its name's end, a regular expression (peft's
    ``get_pattern_key``)."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), None)


def _patterns(config: dict, name: str, kind: type, where: str) -> dict:
    """``rank_pattern`` (positive integers) or ``alpha_pattern`` (numbers) of an adapter_config.json, checked."""
    patterns = config.get(name) or {}
    if not isinstance(patterns, dict):
        raise ValueError(f"{where}: adapter_config.json {name} {patterns!r} is not an object of module patterns")
    for pattern, value in patterns.items():
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{where}: adapter_config.json {name} key {pattern!r} is not a regular expression: "
                             f"{exc}") from None
        good = isinstance(value, int) and value >= 1 if kind is int else \
            isinstance(value, (int, float)) and math.isfinite(value)
        if isinstance(value, bool) or not good:
            raise ValueError(f"{where}: adapter_config.json {name} {pattern!r}: {value!r} is not "
                             + ("a positive integer rank" if kind is int else "a number"))
    return {pattern: kind(value) for pattern, value in patterns.items()}


def read_adapter(request: LoRARequest) -> Adapter:
    """Read a PEFT adapter directory; a ValueError naming the adapter and what is wrong with it."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    path = Path(request.lora_path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(f"{where}: {needed.name} not found")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: adapter_config.json is not JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) or config["r"] < 1:
        raise ValueError(f"{where}: adapter_config.json has no positive integer r")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config['peft_type']!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{where}: adapter_config.json {key} {config[key]!r}: {what} is not supported")
    for parameter in config.get("target_parameters") or ():
        if not isinstance(parameter, str) or parameter.rpartition(".")[2] not in _EXPERT_PARAMETERS:
            raise ValueError(f"{where}: adapter_config.json target_parameters {parameter!r}: only a "
                             f"mixture-of-experts' fused expert tensors ({', '.join(_EXPERT_PARAMETERS)}) take "
                             "adapters on parameters")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: adapter_config.json bias {config['bias']!r}: only 'none' is supported")
    rank_pattern, alpha_pattern = (_patterns(config, "rank_pattern", int, where),
                                   _patterns(config, "alpha_pattern", float, where))
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - a damaged file, named
        raise ValueError(f"{where}: adapter_model.safetensors cannot be read: {exc}") from None
    alpha = config.get("lora_alpha", config["r"])
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{where}: adapter_config.json lora_alpha {alpha!r} is not a number")
    adapter = Adapter(request.lora_name, config["r"], float(alpha),
                      bool(config.get("use_rslora")), rank_pattern, alpha_pattern)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{where}: tensor {key} is not a lora_A/lora_B weight (embedding and bias "
                             "adapters are not supported)")
        module = key[:-len(suffix)].removeprefix(_PREFIX)
        halves.setdefault(module, {})[suffix] = tensor
    for module, pair in halves.items():
        if len(pair) != 2:
            raise ValueError(f"{where}: module {module} lacks its lora_A or lora_B weight")
        adapter.modules[module] = (pair[_SUFFIXES[0]], pair[_SUFFIXES[1]])
    if not adapter.modules:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return adapter


def _held_name(name: str, held: dict[str, Any]) -> str:
    """The model's name for an adapter's module: ``name`` itself, else the one name in ``held`` of which it is a
    dotted suffix or which is one of it (an adapter made on a bare decoder, ``layers.0...``, on the model's
    ``model.layers.0...``; one made on a classifier, ``bert.encoder...``, on ``encoder...``, as the checkpoint's
    weights are loaded)."""
    if name in held:
        return name
    found = [other for other in held if other.endswith("." + name) or name.endswith("." + other)]
    return found[0] if len(found) == 1 else name


def _check_rank(adapter: Adapter, key: str, rank: int, name: str) -> None:
    """A module's rank as its weights hold it against the config's (``r``, or ``rank_pattern``'s for it)."""
    if rank != adapter.rank_of(key):
        raise ValueError(f"{name}: lora_A holds rank {rank} where adapter_config.json gives {key} r "
                         f"{adapter.rank_of(key)}" + (" (rank_pattern)" if _pattern_key(adapter.rank_pattern, key)
                                                       else ""))


class ModelLoRA:
    """A model's adapter slots: a ``LoRALayer`` on each of its linear layers that adapters may target, and the
    step's token -> slot mapping they share. ``load`` puts an adapter in a slot; ``prepare`` maps a step.
    ``kernel``: the backend's ``lora_sgmv`` op, or None. A mixture-of-experts layer's routed experts hold an
    ``ExpertLoRA``.

    ``targets``: what each adaptable module must fit, by name: a linear layer's ``(LinearShapes, shard id ->
    projection)``, a layer's experts' ``ExpertShapes``. Under pipeline parallelism a stage holds the slots of its own
    decoder layers, and ``share_targets`` adds the other stages' targets, so that the driver checks every module
    of an adapter (which no stage then meets unchecked) and each stage loads those of its own layers."""

    def __init__(self, model: nn.Module, routes: tuple, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str, kernel: Any = None) -> None:
        self.routes, self.mapping = routes, LoRAMapping(device)
        self.layers: dict[str, Any] = {}
        self.experts: dict[str, FusedExperts] = {}
        self.targets: dict[str, Any] = {}
        for name, module in model.named_modules():
            if isinstance(module, FusedExperts):
                module.lora = ExpertLoRA(module.num_experts, module.hidden_size, module.intermediate_size,
                                         module.shard_size, module.tp_rank, max_loras, max_rank, self.mapping, dtype,
                                         device)
                self.experts[name], self.targets[name] = module, module.lora.shapes
            elif hasattr(module, "quant_method") and hasattr(module, "shard") and module.shard.dim is not None \
                    and "experts" not in name.split("."):  # experts: adapted by their layer's ExpertLoRA
                module.lora = LoRALayer(module.input_size, module.shard, max_loras, max_rank, self.mapping, dtype,
                                        device, kernel)
                self.layers[name] = module
                projections = {shard: module._projection(shard) for fused, _, shard in routes
                               if fused in name + "." and not isinstance(shard, tuple)}
                self.targets[name] = (module.lora.shapes, projections)
        # a checkpoint's expert projection name (w1, gate_proj, ...) -> its part
        self._expert_parts = {match[1]: ("down" if shard[1] is None else ("gate", "up")[shard[1]])
                              for _, part, shard in routes
                              if (match := re.fullmatch(r"\.experts\.\d+\.(\w+)\.weight", part)) is not None}
        self._experts_of_layer: dict[str, str] = {}
        self.share_targets([])
        self._slot_of_seq: dict[int, int] = {}
        self._token_slots: np.ndarray | None = None

    def share_targets(self, others: list[dict[str, Any]]) -> None:
        """Add every stage's ``targets`` (pipeline parallelism: each holds its own decoder layers')."""
        for targets in others:
            self.targets.update(targets)
        # decoder layer ("model.layers.3") -> the name of its experts
        self._experts_of_layer = {match["layer"]: name for name, target in self.targets.items()
                                  if isinstance(target, ExpertShapes) and (match := _EXPERTS.match(name))}

    def _target(self, module: str) -> tuple[str, int]:
        """The linear layer and projection index a PEFT module name lands on (q_proj -> qkv_proj's q)."""
        name = module + "."
        for fused, part, shard in self.routes:
            if part in name:
                layer = _held_name(name.replace(part, fused)[:-1], self.targets)
                if isinstance(self.targets.get(layer), tuple):
                    return layer, self.targets[layer][1][shard]
        layer = _held_name(module, self.targets)
        if not isinstance(self.targets.get(layer), tuple):
            raise KeyError(module)
        return layer, 0

    def resolve(self, adapter: Adapter, request: LoRARequest) -> dict[str, dict]:
        """This stage's layers' parts of the adapter: layer name -> projection -> (A, B, scale), experts' name ->
        (expert, part) -> (A, B, scale); every module of every stage checked, a ValueError naming the adapter's
        module."""
        where = f"LoRA adapter {request.lora_name!r}"
        placed: dict[str, dict] = {}
        for module, (a, b) in adapter.modules.items():
            match = _EXPERTS.match(module)
            if match is not None:
                self._resolve_experts(match, module, a, b, adapter, f"{where} module {module}", placed)
                continue
            try:
                name, index = self._target(module)
            except KeyError:
                raise ValueError(f"{where}: target module {module} is not a linear layer of this model "
                                 "(LoRA applies to its attention and MLP projections)") from None
            self.targets[name][0].check(index, a, b, f"{where} module {module}")
            _check_rank(adapter, module, a.shape[0], f"{where} module {module}")
            if name in self.layers:  # else another pipeline stage's, loaded there
                placed.setdefault(name, {})[index] = (a, b, adapter.scale_of(module))
        return placed

    def _resolve_experts(self, match: re.Match, module: str, a: torch.Tensor, b: torch.Tensor, adapter: Adapter,
                         name: str, placed: dict[str, dict]) -> None:
        """One adapter module on routed experts (``match``: of its name as loaded) as (expert, part) -> (A, B,
        scale) of its layer's experts, checked."""
        layer = match["layer"]
        owner = self._experts_of_layer.get(_held_name(layer, self._experts_of_layer))
        if owner is None:
            raise ValueError(f"{name}: {layer} has no mixture-of-experts experts (LoRA applies to the attention "
                             "and MLP projections, and to a sparse layer's experts)")
        shapes = self.targets[owner]
        count = shapes.num_experts
        if match["expert"] is not None:  # one expert's linear, named as the checkpoint's
            part, expert = self._expert_parts.get(match["proj"]), int(match["expert"])
            if part is None or expert >= count:
                raise ValueError(f"{name}: not an expert projection of this model (experts 0-{count - 1}, "
                                 f"projections {', '.join(self._expert_parts)})")
            key, rank = module, a.shape[0]
            parts = {(expert, part): (a, b)}
        else:  # a fused expert tensor: A [r * E, in], B [out, r * E]; expert e's ranks at r * e (A), every E-th (B)
            part = {shapes.of(p): p for p in ("gate_up", "down")}.get((a.shape[-1], b.shape[0])) \
                if a.dim() == b.dim() == 2 else None
            if part is None or a.shape[0] % count or b.shape[1] != a.shape[0]:
                raise ValueError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit neither the "
                                 f"experts' gate_up_proj nor their down_proj ([r * {count}, in] and [out, r * {count}]:"
                                 f" gate_up {shapes.of('gate_up')[::-1]}, down {shapes.of('down')[::-1]})")
            rank = a.shape[0] // count
            # peft's name for a fused tensor's pattern: the experts' module (no wrapper) and the parameter
            key = re.sub(r"(\.base_layer)+$", "", module) + "." + _EXPERT_PARAMETERS[part == "down"]
            a_of, b_of = a.reshape(count, rank, -1), b.reshape(b.shape[0], rank, count)
            parts = {(expert, part): (a_of[expert], b_of[:, :, expert]) for expert in range(count)}
        target, scale = placed.setdefault(owner, {}), adapter.scale_of(key)
        for (expert, part), (a_part, b_part) in parts.items():
            shapes.check(part, a_part, b_part, name)
            block = PARTS[part][:2]
            if any(PARTS[held][:2] == block for e, held in target if e == expert):
                raise ValueError(f"{name}: expert {expert}'s {part} projection is adapted twice")
            target[(expert, part)] = (a_part, b_part, scale)
        _check_rank(adapter, key, rank, name)
        if owner not in self.experts:  # another pipeline stage's, loaded there
            placed.pop(owner)

    def load(self, slot: int, request: LoRARequest) -> None:
        adapter = read_adapter(request)
        placed = self.resolve(adapter, request)
        for name, layer in self.layers.items():
            layer.lora.set_slot(slot, placed.get(name, {}))
        for name, experts in self.experts.items():
            experts.lora.set_slot(slot, placed.get(name, {}))

    def prepare(self, step: Any, seq_ids: list[int], query_start_loc: np.ndarray) -> None:
        """Map this step's tokens to their rows' slots (``step``: a ``StepData``; its loads done first)."""
        for slot, path, name, int_id in step.lora_loads:
            self.load(slot, LoRARequest(name, int_id, path))
        if step.reset:
            self._slot_of_seq = {}
        for seq_id in step.removed_ids:
            self._slot_of_seq.pop(seq_id, None)
        for row in step.new_rows:
            if row.lora_slot >= 0:
                self._slot_of_seq[row.seq_id] = row.lora_slot
        if not self._slot_of_seq:
            self.mapping.clear()
            return
        if step.same_rows and step.num_new_tokens is None and self._token_slots is not None \
                and not step.new_rows and not step.removed_ids and len(self._token_slots) == len(seq_ids):
            return  # the last decode step's rows again: the same map
        row_slots = np.fromiter((self._slot_of_seq.get(s, -1) for s in seq_ids), np.int64, len(seq_ids))
        self._token_slots = np.repeat(row_slots, np.diff(query_start_loc))
        self.mapping.set(self._token_slots)


class LoRASlotTable:
    """The driver's record of which adapter each of ``max_loras`` slots holds, least recently used evicted
    first (never one a row of the step being built uses)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slots: dict[bytes, int] = {}  # adapter key -> slot, least recently used first

    def slot_for(self, request: LoRARequest, in_use: set[bytes],
                 loads: list[tuple[int, str, str, int]]) -> int:
        """The slot holding ``request``'s adapter, loading it (appended to ``loads``) where it is not held."""
        key = request.key
        slot = self._slots.pop(key, None)
        if slot is None:
            free = set(range(self.max_loras)) - set(self._slots.values())
            if free:
                slot = min(free)
            else:
                victim = next((k for k in self._slots if k not in in_use), None)
                if victim is None:
                    raise RuntimeError(f"more than max_loras {self.max_loras} adapters in one step")
                slot = self._slots.pop(victim)
            loads.append((slot, request.lora_path, request.lora_name, request.lora_int_id))
        self._slots[key] = slot
        return slot

    def forget(self) -> None:
        self._slots = {}
