"""GraniteForCausalLM: the Llama block with four scalars (embedding, attention, residual, logits)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import BuildContext, KVCacheSpec
from pluginfer.layers.attention import bind_kv_caches
from pluginfer.layers.causal_lm import add_and_norm
from pluginfer.layers.embedding import LMHead, VocabParallelEmbedding
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.layers.self_attention import SelfAttention
from pluginfer.layers.weights import load_named_weights


class GraniteDecoderLayer(nn.Module):
    def __init__(self, config: dict, rope: RotaryEmbedding) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        bias = bool(config.get("attention_bias", False))
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads,
                                       config.get("head_dim") or hidden // heads, rope, qkv_bias=bias,
                                       output_bias=bias, scale=config["attention_multiplier"])
        self.mlp = GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"),
                            bias=bool(config.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))
        self.post_attention_layernorm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))
        self.residual_multiplier = config["residual_multiplier"]

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Each block's output is scaled before it joins the residual stream (the norm adds it).
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(batch, hidden) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteForCausalLM(nn.Module):
    can_generate = True  # ModelPipeline.can_generate: it always has its LM head

    def __init__(self, config: dict, ctx: BuildContext) -> None:
        super().__init__()
        if ctx.rank.pp_size > 1:  # this example keeps every layer on one stage
            raise ValueError(f"parallel.pipeline_parallel_size: {ctx.rank.pp_size} stages; GraniteForCausalLM "
                             "runs on one pipeline stage (tensor parallelism works)")
        for field in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
            if not isinstance(config.get(field), (int, float)):
                raise ValueError(f"config.json: {field} must be a number for GraniteForCausalLM, "
                                 f"got {config.get(field)!r}")
        self.config = config
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rope = get_rope(config, head_dim, max_position=ctx.max_model_len)
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(GraniteDecoderLayer(config, rope) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))
        self.lm_head = LMHead(config["vocab_size"], config["hidden_size"])
        self.tied = bool(config.get("tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie(self.embed_tokens)

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.layers[0].self_attn
        return KVCacheSpec(len(self.layers), attn.num_kv_heads, attn.head_dim)

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        bind_kv_caches(self, kv_caches)

    def forward(self, batch: ForwardBatch, intermediate: object = None) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids) * self.config["embedding_multiplier"]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(batch, hidden, residual)
        rows = batch.logits_indices
        return self.norm(hidden[rows] + residual[rows])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float() / self.config["logits_scaling"]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # HF names the decoder stack "model.*"; here it sits at the top level.
        renamed = ((name.removeprefix("model."), tensor) for name, tensor in weights
                   if not (self.tied and name == "lm_head.weight"))
        load_named_weights(self, renamed, optional=("lm_head.",) if self.tied else ())


def build(hf_config: dict, ctx: BuildContext) -> GraniteForCausalLM:
    return GraniteForCausalLM(hf_config, ctx)
