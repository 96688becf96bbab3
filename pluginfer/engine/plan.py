"""RankPlan: the config resolved once, before a rank builds anything.

A rank's build reads the config in one place: the checkpoint and its metadata, which plugin serves each
kind (backend, collective, model, quant), the dtypes and the context length. ``resolve_plan`` makes every
choice and every check that needs no built object; ``executor.start_rank`` and the ``Worker`` then build
from the plan alone. The one choice left to the build is a collective under ``auto`` for which no plugin
names the launcher: that is the built backend's ``default_collective``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pluginfer.core.config import EngineConfig
from pluginfer.core.hookspecs import PluginSpec
from pluginfer.core.protocols import RankInfo
from pluginfer.core.registry import Registry
from pluginfer.engine.loader import open_checkpoint, read_hf_config, resolve_dtype, resolve_model_path
from pluginfer.formats.gguf.checkpoint import GGUFCheckpoint
from pluginfer.layers.kv_quant import QUANTIZED_KV_DTYPES
from pluginfer.layers.rotary import rope_parameters

_DEFAULT_CONTEXT = 2048


@dataclass(frozen=True)
class RankPlan:
    """What one rank builds: the config, its checkpoint and every choice made from them."""

    config: EngineConfig
    model_path: Path
    # a GGUF file's metadata parsed once, for the config and the weights
    checkpoint: Path | GGUFCheckpoint
    hf_config: dict
    backend: str  # plugin names, resolved
    collective: str | None  # None: the built backend's default_collective
    model: str
    quant: str
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    max_model_len: int
    # spent resolving (finding the checkpoint, reading its metadata)
    seconds: float

    @property
    def plugins(self) -> list[tuple[str, str]]:
        """(kind, name) of the plugins every rank must agree on."""
        return [("backend", self.backend), ("model", self.model), ("quant", self.quant)]

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.config.cache.block_size)


def resolve_plan(config: EngineConfig, rank: RankInfo, registry: Registry) -> RankPlan:
    """Every choice a rank's build needs, made from the config and the checkpoint's metadata."""
    started = time.perf_counter()
    path = resolve_model_path(config.model, config.revision)
    checkpoint = open_checkpoint(path)
    hf_config = read_hf_config(checkpoint)
    dtype = resolve_dtype(config.dtype, hf_config)
    kind = config.cache.kv_cache_dtype
    collective = _collective_name(config.parallel.collective, rank, registry)
    return RankPlan(config=config, model_path=path, checkpoint=checkpoint, hf_config=hf_config,
                    backend=_usable(registry, "backend", _backend_name(config.backend, registry)),
                    collective=collective and _usable(registry, "collective", collective),
                    model=_model_spec(hf_config, path, registry).name,
                    quant=_usable(registry, "quant", _quant_name(config.quant, hf_config, registry)), dtype=dtype,
                    kv_cache_dtype=_kv_cache_dtype(kind, config.dtype, dtype, hf_config),
                    max_model_len=_max_model_len(config, hf_config), seconds=time.perf_counter() - started)


def _kv_cache_dtype(kind: str, dtype_name: str, dtype: torch.dtype, hf_config: dict) -> torch.dtype:
    """The cache's storage dtype: the model's (auto), a float dtype, or a quantized cache's code dtype. A GGUF
    file computes in float32 unless ``dtype`` says otherwise; its auto cache is then float16, as llama.cpp keeps
    it (half the bytes every decode step reads); ``dtype float32`` asked for by name keeps a float32 cache."""
    if kind == "auto":
        gguf = (hf_config.get("quantization_config") or {}).get("quant_method") == "gguf"
        return torch.float16 if gguf and dtype_name == "auto" and dtype == torch.float32 else dtype
    return QUANTIZED_KV_DTYPES.get(kind) or resolve_dtype(kind, {})


def build_plugin(registry: Registry, kind: str, name: str, *arguments: object) -> Any:
    """The ``kind`` plugin ``name`` built with ``arguments``; an error naming it when it cannot run here."""
    return registry.load(kind, _usable(registry, kind, name))(*arguments)


def _usable(registry: Registry, kind: str, name: str) -> str:
    """The spec name ``name`` resolves to (an alias to its plugin's name); an error when unknown or unusable here."""
    spec = registry.resolve(kind, name)
    usable, reason = registry.usable(spec)
    if not usable:
        raise RuntimeError(f"{kind} plugin {spec.name!r} cannot run here: {reason}")
    return spec.name


def _backend_name(name: str, registry: Registry) -> str:
    if name != "auto":
        return name
    usable = [spec for spec in registry.specs("backend") if registry.usable(spec)[0]]
    if not usable:
        raise RuntimeError("backend auto: no usable device backend plugin (see `pluginfer plugins`)")
    return max(usable, key=lambda spec: spec.priority).name


def _collective_name(name: str, rank: RankInfo, registry: Registry) -> str | None:
    if name != "auto":
        return name
    spec = registry.for_launcher("collective", rank.launcher)  # a collective made for this launcher
    return spec.name if spec is not None else None


def _quant_name(name: str, hf_config: dict, registry: Registry) -> str:
    if name != "auto":
        return name
    quant_config = hf_config.get("quantization_config") or {}
    claimed = registry.claiming("quant", quant_config)  # e.g. Marlin-format GPTQ; plain weights
    if claimed is not None:
        return claimed.name
    if "quant_method" not in quant_config:
        raise ValueError("quant auto: no quant plugin serves this checkpoint's weights (quantization_config: "
                         f"{quant_config or 'none'}); name one with --quant")
    return quant_config["quant_method"]


def _model_spec(hf_config: dict, path: Path, registry: Registry) -> PluginSpec:
    names = list(hf_config.get("architectures") or [])
    if hf_config.get("model_type"):
        names.append(hf_config["model_type"])
    if not names:
        raise ValueError(f"{path / 'config.json'} names no architectures and no model_type")
    return registry.resolve_any("model", names)


_PADDED_POSITIONS = ("roberta", "xlm-roberta", "camembert")  # RoBERTa-style encoders (models/bert.py)


def _max_model_len(config: EngineConfig, hf_config: dict) -> int:
    native = int(hf_config.get("max_position_embeddings") or _DEFAULT_CONTEXT)
    if hf_config.get("model_type") in _PADDED_POSITIONS:  # positions start past pad_token_id: those rows are unused
        native -= int(hf_config.get("pad_token_id") or 0) + 1
    _, scaling = rope_parameters(hf_config)
    if scaling["rope_type"] in ("linear", "dynamic"):  # as vLLM: these stretch the native context
        native = int(native * float(scaling.get("factor", 1.0)))
    elif scaling["rope_type"] == "yarn" and scaling.get("factor"):  # as vLLM: the original context times factor
        original = hf_config.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        native = max(native, int(int(original or native) * float(scaling["factor"])))
    if config.max_model_len is None:
        return native
    if config.max_model_len > native:
        raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings ({native})")
    return config.max_model_len
