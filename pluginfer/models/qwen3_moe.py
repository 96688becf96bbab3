"""Qwen3-MoE pipeline: Qwen3's attention (per-head q/k RMSNorm) with sparse mixture-of-experts layers.

A layer is sparse unless it is listed in ``mlp_only_layers`` or ``(index + 1) % decoder_sparse_step != 0``
(then it keeps a dense MLP of ``intermediate_size``); ``norm_topk_prob`` renormalizes the top-k weights.
"""

from __future__ import annotations

from pluginfer.core.protocols import BuildContext
from pluginfer.layers.causal_lm import (
    CausalLM,
    DecoderStack,
    PreNormDecoderLayer,
    check_activation,
    check_kv_heads,
    check_positive_fields,
)
from pluginfer.layers.context import current_context
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.moe import SparseMoeBlock, expert_weight_names
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.layers.router import validate_router_config
from pluginfer.layers.self_attention import SelfAttention
from pluginfer.layers.weights import LLAMA_STACKED


def head_dim_of(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def num_experts_of(config: dict) -> int:
    """``num_experts`` (saved by transformers as ``num_local_experts``)."""
    return config.get("num_experts", config.get("num_local_experts"))


def sparse_layers(config: dict) -> list[bool]:
    """Which layers hold experts, as transformers' Qwen3MoeDecoderLayer decides."""
    mlp_only, step = config.get("mlp_only_layers") or [], config.get("decoder_sparse_step", 1)
    return [i not in mlp_only and num_experts_of(config) > 0 and (i + 1) % step == 0
            for i in range(config["num_hidden_layers"])]


class Qwen3MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, rope: RotaryEmbedding, sparse: bool) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        hidden, heads, head_dim = config["hidden_size"], config["num_attention_heads"], head_dim_of(config)
        bias = bool(config.get("attention_bias", False))
        window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads, head_dim, rope,
                                       qkv_bias=bias, output_bias=bias, sliding_window=window,
                                       q_norm=RMSNorm(head_dim, eps), k_norm=RMSNorm(head_dim, eps))
        act = config.get("hidden_act", "silu")
        if sparse:
            self.mlp = SparseMoeBlock(num_experts_of(config), config.get("num_experts_per_tok", 2), hidden,
                                      config["moe_intermediate_size"], bool(config.get("norm_topk_prob", False)), act,
                                      size_field="moe_intermediate_size")
        else:
            self.mlp = GatedMLP(hidden, config["intermediate_size"], act)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)



class Qwen3MoeForCausalLM(CausalLM):
    decoder_layer = Qwen3MoeDecoderLayer  # Qwen2-MoE's pipeline is this one with its own layer and checks

    def __init__(self, config: dict, ctx: BuildContext) -> None:
        self.check_config(config)
        rope = get_rope(config, head_dim_of(config), max_position=ctx.max_model_len, yarn=True)
        sparse = sparse_layers(config)
        super().__init__(config, DecoderStack(config, lambda i: self.decoder_layer(config, rope, sparse[i])))

    @staticmethod
    def check_config(config: dict) -> None:
        validate_config(config)

    def weight_routes(self) -> tuple:
        # Expert names first: LLAMA_STACKED's ".gate_proj." would also match "experts.{e}.gate_proj.".
        experts = expert_weight_names(num_experts_of(self.config), "gate_proj", "up_proj", "down_proj")
        return experts + LLAMA_STACKED


_SUPPORTED_ACTIVATIONS = ("silu",)


def validate_config(config: dict) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    check_positive_fields(config, ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"))
    validate_router_config(config, num_experts_of(config), "num_experts")
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step <= 0:
        raise ValueError(f"config.json: decoder_sparse_step must be a positive integer, got {step!r}")
    sparse = sparse_layers(config)
    for field, needed in (("moe_intermediate_size", any(sparse)), ("intermediate_size", not all(sparse))):
        if needed and (not isinstance(config.get(field), int) or config[field] <= 0):
            raise ValueError(f"config.json: {field} must be a positive integer, got {config.get(field)!r}")
    check_activation(config, "qwen3-moe", _SUPPORTED_ACTIVATIONS)
    check_kv_heads(config)
    window = config.get("sliding_window")
    if config.get("use_sliding_window", False) and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"config.json: sliding_window must be a positive integer when use_sliding_window is "
                         f"true, got {window!r}")


def build(hf_config: dict, ctx: BuildContext) -> Qwen3MoeForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return Qwen3MoeForCausalLM(hf_config, ctx)
