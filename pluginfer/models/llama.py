"""Llama-family pipeline: LlamaForCausalLM and MistralForCausalLM (also llama3, Yi, Mistral).

GQA, explicit ``head_dim``, rope scaling (linear, dynamic, llama3, yarn), tied embeddings,
attention/MLP bias, and Mistral's sliding window.
"""

from __future__ import annotations

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
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.layers.self_attention import SelfAttention


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        bias = bool(config.get("attention_bias", False))
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads,
                                       config.get("head_dim") or hidden // heads, rope, qkv_bias=bias,
                                       output_bias=bias, sliding_window=config.get("sliding_window"))
        self.mlp = GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"),
                            bias=bool(config.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)



class LlamaForCausalLM(CausalLM):
    def __init__(self, config: dict, ctx: BuildContext) -> None:
        validate_config(config)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rope = get_rope(config, head_dim, max_position=ctx.max_model_len, yarn=True)
        super().__init__(config, DecoderStack(config, lambda _: LlamaDecoderLayer(config, rope)))


_SUPPORTED_ACTIVATIONS = ("silu",)


def validate_config(config: dict) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    check_positive_fields(config, DECODER_SIZE_FIELDS)
    check_activation(config, "llama", _SUPPORTED_ACTIVATIONS)
    check_kv_heads(config)


def build(hf_config: dict, ctx: BuildContext) -> LlamaForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return LlamaForCausalLM(hf_config, ctx)
