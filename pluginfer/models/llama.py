"""Llama-family pipeline: LlamaForCausalLM and MistralForCausalLM (also llama3, Yi, Mistral).

GQA, explicit ``head_dim``, rope scaling (linear, dynamic, llama3), tied embeddings,
attention/MLP bias, and Mistral's sliding window.
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.causal_lm import CausalLM, DecoderStack, check_positive_fields
from pluginfer.layers.context import current_context
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.layers.self_attention import SelfAttention


class LlamaDecoderLayer(nn.Module):
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

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(batch, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: dict, ctx: BuildContext) -> None:
        validate_config(config)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rope = get_rope(config, head_dim, max_position=ctx.max_model_len)
        super().__init__(config, DecoderStack(config, lambda _: LlamaDecoderLayer(config, rope)))


_SUPPORTED_ACTIVATIONS = ("silu",)


def validate_config(config: dict) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    check_positive_fields(config, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                   "vocab_size"))
    if config.get("hidden_act", "silu") not in _SUPPORTED_ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported by the llama "
                         f"pipeline (supported: {', '.join(_SUPPORTED_ACTIVATIONS)})")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")


def build(hf_config: dict, ctx: BuildContext) -> LlamaForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return LlamaForCausalLM(hf_config, ctx)
