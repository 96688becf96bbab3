"""LoRA adapters in PEFT's format: the request that names one, reading it, and a model's adapter slots.

An adapter is a directory with ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) and ``adapter_model.safetensors`` (``...<module>.lora_A.weight [r, in]`` and
``...<module>.lora_B.weight [out, r]``). Its modules are mapped onto the model's linear layers by the
model's weight routes (``q_proj`` -> projection ``q`` of ``qkv_proj``), as its checkpoint's tensors are.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pluginfer.engine.lora_request import LoRARequest
from pluginfer.layers.causal_lm import MissingLayer
from pluginfer.layers.lora import LoRALayer, LoRAMapping

_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_PREFIX = "base_model.model."
_UNSUPPORTED = {"use_dora": "DoRA", "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
                "modules_to_save": "modules_to_save",
                "target_parameters": "adapters on parameters (a mixture-of-experts' fused experts)"}


@dataclass
class Adapter:
    """A read adapter: its scale (alpha / r, or alpha / sqrt(r) with rsLoRA) and (A, B) by PEFT module name."""

    name: str
    scale: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


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
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: adapter_config.json bias {config['bias']!r}: only 'none' is supported")
    rank, alpha = config["r"], float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - a damaged file, named
        raise ValueError(f"{where}: adapter_model.safetensors cannot be read: {exc}") from None
    adapter, halves = Adapter(request.lora_name, scale), {}
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


class ModelLoRA:
    """A model's adapter slots: a ``LoRALayer`` on each of its linear layers that adapters may target, and the
    step's token -> slot mapping they share. ``load`` puts an adapter in a slot; ``prepare`` maps a step.
    ``kernel``: the backend's ``lora_sgmv`` op, or None. Under pipeline parallelism a stage holds the slots of its
    own decoder layers: an adapter's modules in the layers another stage holds are that stage's to load."""

    def __init__(self, model: nn.Module, routes: tuple, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str, kernel: Any = None) -> None:
        self.routes, self.mapping = routes, LoRAMapping(device)
        self.layers: dict[str, Any] = {}
        for name, module in model.named_modules():
            if hasattr(module, "quant_method") and hasattr(module, "shard") and module.shard.dim is not None \
                    and "experts" not in name.split("."):  # routed experts take no adapter
                module.lora = LoRALayer(module.input_size, module.shard, max_loras, max_rank, self.mapping, dtype,
                                        device, kernel)
                self.layers[name] = module
        # decoder layers another pipeline stage holds, and one this stage holds (to check a module name against)
        self._elsewhere = tuple(name + "." for name, module in model.named_modules() if isinstance(module, MissingLayer))
        self._held_layer = next((name for name, module in model.named_modules()
                                 if name.rpartition(".")[2].isdigit() and not isinstance(module, MissingLayer)
                                 and any(layer.startswith(name + ".") for layer in self.layers)), None)
        self._slot_of_seq: dict[int, int] = {}
        self._token_slots: np.ndarray | None = None

    def _target(self, module: str) -> tuple[Any, int]:
        """The layer and projection index a PEFT module name lands on (q_proj -> qkv_proj's q)."""
        name = module + "."
        for fused, part, shard in self.routes:
            if part in name:
                layer = self.layers.get(name.replace(part, fused)[:-1])
                if layer is not None:
                    return layer, layer._projection(shard)
        layer = self.layers.get(module)
        if layer is None:
            raise KeyError(module)
        return layer, 0

    def _on_another_stage(self, module: str) -> tuple[Any, int] | None:
        """For ``module`` in a decoder layer another pipeline stage holds: the same module of a layer this stage holds
        (layer, projection), whose shapes it must have (a module has the same shapes in every decoder layer of the
        families served); None for a module of this stage or of no layer."""
        owner = next((prefix for prefix in self._elsewhere if module.startswith(prefix)), None)
        if owner is None or self._held_layer is None:
            return None
        try:
            return self._target(self._held_layer + "." + module[len(owner):])
        except KeyError:
            return None

    def resolve(self, adapter: Adapter, request: LoRARequest) -> dict[str, dict[int, tuple]]:
        """Layer name -> projection -> (A, B), every shape checked; a ValueError naming the adapter's module."""
        where = f"LoRA adapter {request.lora_name!r}"
        placed: dict[str, dict[int, tuple]] = {}
        for module, (a, b) in adapter.modules.items():
            same = self._on_another_stage(module)
            if same is not None:  # the stage holding it loads it; checked here, so that no stage meets a bad one
                same[0].lora.check(same[1], a, b, f"{where} module {module}")
                continue
            try:
                layer, index = self._target(module)
            except KeyError:
                if "experts" in module.split("."):
                    raise ValueError(f"{where}: target module {module} is a mixture-of-experts expert: adapters on "
                                     "routed experts are not supported (attention, dense MLP and shared-expert "
                                     "projections are)") from None
                raise ValueError(f"{where}: target module {module} is not a linear layer of this model "
                                 "(LoRA applies to its attention and MLP projections)") from None
            layer.lora.check(index, a, b, f"{where} module {module}")
            name = next(n for n, m in self.layers.items() if m is layer)
            placed.setdefault(name, {})[index] = (a, b)
        return placed

    def load(self, slot: int, request: LoRARequest) -> None:
        adapter = read_adapter(request)
        placed = self.resolve(adapter, request)
        for name, layer in self.layers.items():
            layer.lora.set_slot(slot, placed.get(name, {}), adapter.scale)

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
