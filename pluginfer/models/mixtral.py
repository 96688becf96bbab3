"""Mixtral pipeline: the Mistral block with a sparse mixture-of-experts feed-forward in every layer.

The router keeps each token's top ``num_experts_per_tok`` experts and always renormalizes their weights.
"""

from __future__ import annotations

import torch

from pluginfer.core.protocols import BuildContext
from pluginfer.layers.causal_lm import (
    DECODER_SIZE_FIELDS,
    CausalLM,
    DecoderStack,
    PreNormDecoderLayer,
    check_activation,
    check_kv_heads,
    check_positive_fields,
)
from pluginfer.layers.context import current_context
from pluginfer.layers.moe import SparseMoeBlock, expert_weight_names
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.layers.router import validate_router_config
from pluginfer.layers.self_attention import SelfAttention
from pluginfer.layers.weights import LLAMA_STACKED


def num_experts_of(config: dict) -> int:
    """``num_local_experts`` (transformers also accepts ``num_experts`` for it)."""
    return config.get("num_local_experts", config.get("num_experts"))


class MixtralDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-5)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads,
                                       config.get("head_dim") or hidden // heads, rope,
                                       sliding_window=config.get("sliding_window"))
        self.block_sparse_moe = SparseMoeBlock(num_experts_of(config), config.get("num_experts_per_tok", 2), hidden,
                                               config["intermediate_size"], renormalize=True,
                                               hidden_act=config.get("hidden_act", "silu"))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(hidden)


class MixtralForCausalLM(CausalLM):
    def __init__(self, config: dict, ctx: BuildContext) -> None:
        validate_config(config)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rope = get_rope(config, head_dim, max_position=ctx.max_model_len)
        stack = DecoderStack(config, lambda _: MixtralDecoderLayer(config, rope), eps_default=1e-5)
        super().__init__(config, stack)

    def weight_routes(self) -> tuple:
        return expert_weight_names(num_experts_of(self.config), "w1", "w3", "w2") + LLAMA_STACKED


_SUPPORTED_ACTIVATIONS = ("silu",)


def validate_config(config: dict) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    check_positive_fields(config, DECODER_SIZE_FIELDS)
    validate_router_config(config, num_experts_of(config), "num_local_experts")
    check_activation(config, "mixtral", _SUPPORTED_ACTIVATIONS)
    check_kv_heads(config)


def build(hf_config: dict, ctx: BuildContext) -> MixtralForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return MixtralForCausalLM(hf_config, ctx)
