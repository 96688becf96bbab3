"""GLM-4 pipeline (Glm4ForCausalLM, GLM-4-0414).

The Llama block plus a norm after attention and after the MLP (before each joins the residual),
q/k/v bias, a fused gate/up projection in the checkpoint, and GPT-J style (interleaved) rope on
the first ``partial_rotary_factor`` (default 0.5) of each head.
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
    check_activation,
    check_kv_heads,
    check_positive_fields,
)
from pluginfer.layers.context import current_context
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope, partial_rotary_dim
from pluginfer.layers.self_attention import SelfAttention


def head_dim_of(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


class Glm4DecoderLayer(nn.Module):
    def __init__(self, config: dict, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads, head_dim_of(config),
                                       rope, qkv_bias=bool(config.get("attention_bias", True)))
        self.mlp = GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_self_attn_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_mlp_layernorm = RMSNorm(hidden, eps)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(batch, hidden))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(CausalLM):
    """The checkpoint's mlp.gate_up_proj is already fused ([gate | up]); it loads as one tensor."""

    def __init__(self, config: dict, ctx: BuildContext) -> None:
        validate_config(config)
        head_dim = head_dim_of(config)
        rope = get_rope(config, head_dim, rotary_dim=partial_rotary_dim(config, head_dim, default_factor=0.5),
                        max_position=ctx.max_model_len, is_neox_style=False)
        super().__init__(config, DecoderStack(config, lambda _: Glm4DecoderLayer(config, rope)))


_SUPPORTED_ACTIVATIONS = ("silu",)


def validate_config(config: dict) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    check_positive_fields(config, DECODER_SIZE_FIELDS)
    check_activation(config, "glm4", _SUPPORTED_ACTIVATIONS)
    check_kv_heads(config)


def build(hf_config: dict, ctx: BuildContext) -> Glm4ForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return Glm4ForCausalLM(hf_config, ctx)
