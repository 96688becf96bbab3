"""Gemma-family pipeline: GemmaForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM (text).

All three: GeGLU MLP, embeddings scaled by ``sqrt(hidden_size)``, ``(1 + w)`` RMSNorm, tied embeddings.
Gemma 2 adds norms after attention and around the MLP, ``query_pre_attn_scalar``, attention and
final-logit soft-capping, and sliding-window layers (``layer_types``). Gemma 3 adds q/k norms and a
rope per layer type (local base for sliding layers, global base and scaling for full ones).
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.causal_lm import (
    DECODER_SIZE_FIELDS,
    CausalLM,
    DecoderStack,
    add_and_norm,
    check_kv_heads,
    check_positive_fields,
)
from pluginfer.layers.context import current_context
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.layers.self_attention import SelfAttention

SLIDING, FULL = "sliding_attention", "full_attention"
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


class GemmaVersion:
    """What one Gemma generation reads from its config."""

    def __init__(self, architecture: str, config: dict) -> None:
        self.generation = {"GemmaForCausalLM": 1, "Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 3}[architecture]
        self.sandwich_norms = self.generation >= 2  # post-attention, pre- and post-feed-forward norms
        self.qk_norm = self.generation == 3
        # Gemma 3 keeps attn_logit_softcapping in its config but transformers never applies it.
        self.attn_soft_cap = config.get("attn_logit_softcapping") if self.generation == 2 else None
        self.final_soft_cap = config.get("final_logit_softcapping") if self.generation >= 2 else None


def hidden_activation(config: dict, generation: int) -> str:
    if generation == 1:
        # transformers reads hidden_act and maps Gemma 1's legacy "gelu" to the tanh form
        field, value = "hidden_act", config.get("hidden_act", "gelu_pytorch_tanh")
        value = "gelu_pytorch_tanh" if value == "gelu" else value
    else:
        field = "hidden_activation" if config.get("hidden_activation") else "hidden_act"
        value = config.get(field) or "gelu_pytorch_tanh"
    if value not in _GELU_TANH:
        raise ValueError(f"config.json: {field} {value!r} is not supported by the gemma pipeline "
                         f"(supported: {', '.join(_GELU_TANH)})")
    return value


def layer_types(config: dict, generation: int) -> list[str]:
    """Each layer's attention kind: Gemma 1 is all full; Gemma 2/3 alternate by ``layer_types`` or pattern."""
    num_layers = config["num_hidden_layers"]
    if generation == 1:
        return [FULL] * num_layers
    types = config.get("layer_types")
    if types is None:
        # hub configs before layer_types: Gemma 2 alternates, Gemma 3 has a period of 6
        period = 2 if generation == 2 else config.get("sliding_window_pattern", 6)
        types = [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"config.json: layer_types must list {num_layers} of {SLIDING!r} / {FULL!r}, got {types!r}")
    if SLIDING in types and not (isinstance(config.get("sliding_window"), int) and config["sliding_window"] > 0):
        raise ValueError(f"config.json: sliding_window must be a positive integer for sliding layers, "
                         f"got {config.get('sliding_window')!r}")
    return list(types)


def rope_configs(config: dict, generation: int) -> dict[str, dict]:
    """The rope config of each layer type, from transformers 5's nested rope_parameters or hub fields."""
    max_positions = config.get("max_position_embeddings", 8192)
    params = dict(config.get("rope_parameters") or {})
    if generation < 3:
        single = {"rope_parameters": params, "rope_scaling": config.get("rope_scaling"),
                  "max_position_embeddings": max_positions}
        if "rope_theta" in config:
            single["rope_theta"] = config["rope_theta"]
        return {SLIDING: single, FULL: single}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        # hub style: rope_theta and rope_scaling are global, rope_local_base_freq is local
        full, local = {**params, **(config.get("rope_scaling") or {})}, {}
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    return {kind: {"rope_parameters": p, "max_position_embeddings": max_positions}
            for kind, p in ((FULL, full), (SLIDING, local))}


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: dict, version: GemmaVersion, rope: RotaryEmbedding, kind: str) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        scalar = config.get("query_pre_attn_scalar") if version.generation >= 2 else None
        self.self_attn = SelfAttention(
            hidden, heads, config.get("num_key_value_heads") or heads, head_dim, rope,
            qkv_bias=bool(config.get("attention_bias", False)), output_bias=bool(config.get("attention_bias", False)),
            scale=None if scalar is None else scalar**-0.5,
            sliding_window=config["sliding_window"] if kind == SLIDING else None,
            q_norm=RMSNorm(head_dim, eps, offset=1.0) if version.qk_norm else None,
            k_norm=RMSNorm(head_dim, eps, offset=1.0) if version.qk_norm else None,
            logit_soft_cap=version.attn_soft_cap)
        self.mlp = GatedMLP(hidden, config["intermediate_size"], hidden_activation(config, version.generation))
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.sandwich_norms = version.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(batch, hidden)
        if not self.sandwich_norms:  # Gemma 1: the llama layout
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(CausalLM):
    """The pipeline for all three generations: embeddings scaled by ``sqrt(hidden)``, ``1 + weight``
    norms, per-layer sliding/global rope, soft-capped logits."""

    def __init__(self, config: dict, ctx: BuildContext, architecture: str) -> None:
        validate_config(config)
        version = GemmaVersion(architecture, config)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        kinds = layer_types(config, version.generation)
        configs = rope_configs(config, version.generation)
        ropes = {kind: get_rope(configs[kind], head_dim, max_position=ctx.max_model_len) for kind in sorted(set(kinds))}
        model = DecoderStack(config, lambda index: GemmaDecoderLayer(config, version, ropes[kinds[index]], kinds[index]),
                             norm=RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6), offset=1.0),
                             embed_scale=config["hidden_size"] ** 0.5)
        super().__init__(config, model, tied_by_default=True)
        self.version = version

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.version.final_soft_cap
        return logits if cap is None else cap * torch.tanh(logits / cap)


def validate_config(config: dict) -> None:
    """Reject field values this pipeline would otherwise misread."""
    check_positive_fields(config, DECODER_SIZE_FIELDS)
    check_kv_heads(config)
    if config.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention true (an encoder) is not supported by the gemma "
                         "pipeline")
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        value = config.get(field)
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"config.json: {field} must be a positive number or null, got {value!r}")


def build(hf_config: dict, ctx: BuildContext) -> GemmaForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    architectures = hf_config.get("architectures") or []
    known = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
    architecture = next((a for a in architectures if a in known), None)
    if architecture is None:
        architecture = {"gemma": known[0], "gemma2": known[1], "gemma3_text": known[2]}.get(hf_config.get("model_type"))
    if architecture is None:
        raise ValueError(f"config.json: architectures {architectures!r} / model_type {hf_config.get('model_type')!r} "
                         f"name no Gemma text model (supported: {', '.join(known)})")
    return GemmaForCausalLM(hf_config, ctx, architecture)
