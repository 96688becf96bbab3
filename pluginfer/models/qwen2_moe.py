"""Qwen2-MoE pipeline (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with sparse layers
that add one shared expert, scaled per token by ``sigmoid(shared_expert_gate(x))``, to the routed experts.

Which layers are sparse, and ``norm_topk_prob``, follow Qwen3-MoE (``qwen3_moe.sparse_layers``).
"""

from __future__ import annotations

import torch

from pluginfer.core.protocols import BuildContext
from pluginfer.layers.causal_lm import PreNormDecoderLayer
from pluginfer.layers.context import current_context
from pluginfer.layers.linear import ReplicatedLinear
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.moe import SparseMoeBlock
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding
from pluginfer.layers.self_attention import SelfAttention
from pluginfer.models import qwen3_moe
from pluginfer.models.qwen3_moe import head_dim_of, num_experts_of, sparse_layers


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus ``shared_expert`` (a gated MLP) times ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, config: dict) -> None:
        hidden, act = config["hidden_size"], config.get("hidden_act", "silu")
        super().__init__(num_experts_of(config), config.get("num_experts_per_tok", 2), hidden,
                         config["moe_intermediate_size"], bool(config.get("norm_topk_prob", False)), act,
                         size_field="moe_intermediate_size")
        self.shared_expert = GatedMLP(hidden, config["shared_expert_intermediate_size"], act,
                                      size_field="shared_expert_intermediate_size")
        self.shared_expert_gate = ReplicatedLinear(hidden, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return super().forward(hidden) + shared


class Qwen2MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, rope: RotaryEmbedding, sparse: bool) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads, head_dim_of(config),
                                       rope, qkv_bias=bool(config.get("qkv_bias", True)))
        if sparse:
            self.mlp = SharedExpertMoeBlock(config)
        else:
            self.mlp = GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


class Qwen2MoeForCausalLM(qwen3_moe.Qwen3MoeForCausalLM):
    decoder_layer = Qwen2MoeDecoderLayer

    @staticmethod
    def check_config(config: dict) -> None:
        validate_config(config)


def validate_config(config: dict) -> None:
    """Qwen3-MoE's checks, the shared expert's size, and no sliding window (no Qwen2-MoE release uses one)."""
    routed = {key: value for key, value in config.items() if key != "shared_expert_intermediate_size"}
    qwen3_moe.validate_config({**routed, "use_sliding_window": False})
    if config.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window = true is not supported by the qwen2-moe pipeline")
    if any(sparse_layers(config)):
        size = config.get("shared_expert_intermediate_size")
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"config.json: shared_expert_intermediate_size must be a positive integer, got {size!r}")


def build(hf_config: dict, ctx: BuildContext) -> Qwen2MoeForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return Qwen2MoeForCausalLM(hf_config, ctx)
