"""Mixtral pipeline: the Mistral block with a sparse mixture-of-experts feed-forward in every layer.

The router keeps each token's top ``num_experts_per_tok`` experts and always renormalizes their weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import BuildContext, KVCacheSpec
from pluginfer.layers.context import current_context
from pluginfer.layers.embedding import LMHead, VocabParallelEmbedding
from pluginfer.layers.moe import SparseMoeBlock, expert_weight_names, validate_router_config
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.layers.self_attention import SelfAttention
from pluginfer.layers.weights import LLAMA_STACKED, load_named_weights


def num_experts_of(config: dict) -> int:
    """``num_local_experts`` (transformers also accepts ``num_experts`` for it)."""
    return config.get("num_local_experts", config.get("num_experts"))


class MixtralDecoderLayer(nn.Module):
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

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(batch, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.block_sparse_moe(hidden), residual


class MixtralModel(nn.Module):
    def __init__(self, config: dict, max_model_len: int) -> None:
        super().__init__()
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rope = get_rope(config, head_dim, max_position=max_model_len)
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(MixtralDecoderLayer(config, rope) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-5))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            hidden, residual = layer(batch, hidden, residual)
        rows = batch.logits_indices  # only the sampled rows need the final norm
        return self.norm(hidden[rows] + residual[rows])


class MixtralForCausalLM(nn.Module):
    """``model`` (decoder stack) and ``lm_head``, named as in HF checkpoints."""

    def __init__(self, config: dict, ctx: BuildContext) -> None:
        super().__init__()
        validate_config(config)
        self.config = config
        self.model = MixtralModel(config, ctx.max_model_len)
        self.lm_head = LMHead(config["vocab_size"], config["hidden_size"])
        self.tied = bool(config.get("tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie(self.model.embed_tokens)

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.model.layers[0].self_attn
        return KVCacheSpec(len(self.model.layers), attn.num_kv_heads, attn.head_dim)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.tied:
            weights = ((name, tensor) for name, tensor in weights if name != "lm_head.weight")
        experts = expert_weight_names(num_experts_of(self.config), "w1", "w3", "w2")
        load_named_weights(self, weights, stacked=experts + LLAMA_STACKED,
                           optional=("lm_head.",) if self.tied else ())


_SUPPORTED_ACTIVATIONS = ("silu",)


def validate_config(config: dict) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    for field in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if not isinstance(config.get(field), int) or config[field] <= 0:
            raise ValueError(f"config.json: {field} must be a positive integer, got {config.get(field)!r}")
    validate_router_config(config, num_experts_of(config), "num_local_experts")
    if config.get("hidden_act", "silu") not in _SUPPORTED_ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported by the mixtral "
                         f"pipeline (supported: {', '.join(_SUPPORTED_ACTIVATIONS)})")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")


def build(hf_config: dict, ctx: BuildContext) -> MixtralForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return MixtralForCausalLM(hf_config, ctx)
