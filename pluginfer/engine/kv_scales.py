"""Fixed KV cache scales a checkpoint ships, for a quantized cache (``layers/kv_quant.py``): every row a layer's
head writes then takes that head's scale instead of its own absmax's.

Two places hold them. ``kv_cache_scales.json`` beside the weights (vLLM's ``--quantization-param-path`` schema,
which KsanaLLM reads from the model directory too): ``{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor":
{"<tp rank>": {"<layer>": scale}}}}``, one scale per layer for its keys and values. Or tensors in the
safetensors (compressed-tensors and ModelOpt checkpoints): ``model.layers.<i>.self_attn.k_scale`` and
``v_scale``, a scalar or one per KV head. A file that does not fit the model is an error naming the layer.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from pluginfer.core.protocols import RankInfo
from pluginfer.layers import kv_quant

logger = logging.getLogger(__name__)

SCALE_FILE = "kv_cache_scales.json"
_SCALE_TENSOR = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")
# The scale file's dtype names, and compressed-tensors' kv_cache_scheme types, of each cache dtype.
_FILE_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                "float8_e5m2": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
_SCHEME_TYPES = {"float": (torch.float8_e4m3fn, torch.float8_e5m2), "int": (torch.int8,)}


class ScaleTensors:
    """Takes the ``k_scale`` / ``v_scale`` tensors out of a checkpoint's weight stream (no layer has them)."""

    def __init__(self) -> None:
        self.found: dict[tuple[int, str], torch.Tensor] = {}  # (layer, "k" or "v") -> scales

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            match = _SCALE_TENSOR.match(name)
            if match is None:
                yield name, tensor
            else:
                self.found[int(match.group(1)), match.group(2)] = torch.as_tensor(tensor).float().flatten()


def fixed_scales(model_path: Path, tensors: ScaleTensors, hf_config: dict, dtype: torch.dtype, num_kv_heads: int,
                 layers: range, rank: RankInfo) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """This rank's ``(key scales, value scales)`` ``[its KV heads]`` for each of its ``layers``, or None when the
    checkpoint ships none (or the cache is not quantized: a float cache ignores them)."""
    if not kv_quant.is_quantized(dtype):
        return None
    num_layers = int(hf_config.get("num_hidden_layers") or len(layers))
    file = model_path / SCALE_FILE if model_path.is_dir() else None
    if file is not None and file.is_file():
        per_layer = _read_scale_file(file, dtype, rank)
        found = {(layer, kind): torch.tensor([scale]) for layer, scale in per_layer.items() for kind in "kv"}
        source = str(file)
    elif tensors.found:
        _check_scheme(hf_config, dtype)
        found, source = tensors.found, "the checkpoint's k_scale/v_scale tensors"
    else:
        return None
    total_heads = int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])
    scales = []
    for layer in layers:
        pair = []
        for kind in "kv":
            if (layer, kind) not in found:
                raise ValueError(f"{source}: no {kind}_scale for layer {layer} (the model has {num_layers} layers)")
            pair.append(_rank_heads(found[layer, kind], layer, kind, total_heads, num_kv_heads, rank, source))
        scales.append((pair[0], pair[1]))
    extra = sorted({layer for layer, _ in found} - set(range(num_layers)))
    if extra:
        raise ValueError(f"{source}: scales for layer {extra[0]}, but the model has {num_layers} layers")
    logger.info("KV cache scales fixed per layer and KV head from %s", source)
    return scales


def _read_scale_file(path: Path, dtype: torch.dtype, rank: RankInfo) -> dict[int, float]:
    try:
        cache = json.loads(path.read_text())["kv_cache"]
        by_rank = cache["scaling_factor"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a KV cache scale file ({{'kv_cache': {{'scaling_factor': {{rank: {{layer: "
                         f"scale}}}}}}}}): {exc}") from None
    named = cache.get("dtype")
    if named is not None and _FILE_DTYPES.get(named) != dtype:
        raise ValueError(f"{path}: its scales are for a {named} KV cache, but cache.kv_cache_dtype is "
                         f"{kv_quant.dtype_name(dtype)}")
    key = str(rank.tp_rank)
    if key not in by_rank:
        if len(by_rank) != 1:
            raise ValueError(f"{path}: no scales for tensor-parallel rank {rank.tp_rank} (it has ranks "
                             f"{', '.join(sorted(by_rank))})")
        key = next(iter(by_rank))  # one scale per layer fits every rank's heads
    scales = {}
    for layer, scale in by_rank[key].items():
        if not str(layer).isdigit():
            raise ValueError(f"{path}: layer {layer!r} is not a layer index")
        if not isinstance(scale, int | float) or not scale > 0:
            raise ValueError(f"{path}: layer {layer}: the scale {scale!r} is no positive number")
        scales[int(layer)] = float(scale)
    return scales


def _check_scheme(hf_config: dict, dtype: torch.dtype) -> None:
    scheme = (hf_config.get("quantization_config") or {}).get("kv_cache_scheme") or {}
    kind = scheme.get("type")
    if kind in _SCHEME_TYPES and dtype not in _SCHEME_TYPES[kind]:
        raise ValueError(f"config.json: kv_cache_scheme type {kind!r} calibrated the checkpoint's k_scale/v_scale "
                         f"for another KV cache than cache.kv_cache_dtype {kv_quant.dtype_name(dtype)}")


def _rank_heads(scales: torch.Tensor, layer: int, kind: str, total_heads: int, num_kv_heads: int, rank: RankInfo,
                source: str) -> torch.Tensor:
    """The scales of this rank's KV heads from one scale or one per head of the model."""
    if scales.numel() == 1:
        values = scales.expand(num_kv_heads)
    elif scales.numel() == total_heads:
        if total_heads >= rank.tp_size:
            values = scales[rank.tp_rank * num_kv_heads:(rank.tp_rank + 1) * num_kv_heads]
        else:  # replicated: this rank holds one head
            values = scales[rank.tp_rank * total_heads // rank.tp_size].reshape(1)
    else:
        raise ValueError(f"{source}: layer {layer}: {scales.numel()} {kind}_scale values, but the model has "
                         f"{total_heads} KV heads (one scale, or one per KV head)")
    if not bool((values > 0).all()) or not bool(values.isfinite().all()):
        raise ValueError(f"{source}: layer {layer}: a {kind}_scale is not a positive number")
    return values.float().contiguous()
