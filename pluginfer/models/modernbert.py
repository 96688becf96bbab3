"""ModernBERT encoder: ``ModernBertModel`` (embeddings), ``ModernBertForSequenceClassification`` (cross-encoders).

Pre-norm blocks with bias-free LayerNorms (the first layer has no attention norm), rotary positions, a GeGLU
feed-forward (``Wo(act(x) * gate)``), and attention that alternates: every ``global_attn_every_n_layers``-th
layer sees the whole sequence (``full_attention``, rope theta 160000), the others a band of
``local_attention // 2`` tokens each side (``sliding_attention``, theta 10000). Like BERT it is bidirectional
(``is_causal`` False) and keeps no KV cache; the classifier reads the first token:
``classifier(norm(act(dense(h))))``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pluginfer.core.batch import TOKEN_TYPE_SHIFT, ForwardBatch
from pluginfer.core.protocols import BuildContext, KVCacheSpec
from pluginfer.layers.activation import activation
from pluginfer.layers.causal_lm import check_positive_fields
from pluginfer.layers.context import current_context
from pluginfer.layers.embedding import VocabParallelEmbedding
from pluginfer.layers.encoder_attention import EncoderAttention
from pluginfer.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pluginfer.layers.norm import LayerNorm
from pluginfer.layers.rotary import RotaryEmbedding
from pluginfer.layers.weights import load_named_weights

_SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                "max_position_embeddings")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_THETAS = {"full_attention": ("global_rope_theta", 160000.0), "sliding_attention": ("local_rope_theta", 10000.0)}


def layer_types(config: dict) -> list[str]:
    """Each layer's attention, from ``layer_types`` or (older configs) ``global_attn_every_n_layers``."""
    every = config.get("global_attn_every_n_layers", 3)
    types = config.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                          for i in range(config["num_hidden_layers"])]
    if len(types) != config["num_hidden_layers"] or any(kind not in _LAYER_TYPES for kind in types):
        raise ValueError(f"config.json: layer_types {types!r}: one of {', '.join(_LAYER_TYPES)} per layer")
    return types


def rope_theta(config: dict, kind: str) -> float:
    """The rope base of a layer type: ``rope_parameters[kind]``, else the older ``global/local_rope_theta``."""
    parameters = (config.get("rope_parameters") or {}).get(kind) or {}
    if parameters.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: rope_parameters.{kind}.rope_type {parameters['rope_type']!r} is not "
                         "supported by the modernbert pipeline (supported: default)")
    field, default = _THETAS[kind]
    return float(parameters.get("rope_theta", config.get(field, default)))


class ModernBertLayer(nn.Module):
    def __init__(self, config: dict, index: int, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        eps, norm_bias = config.get("norm_eps", 1e-5), config.get("norm_bias", False)
        bias, head_dim = config.get("mlp_bias", False), hidden // heads
        # layer 0 has no attention norm: the embeddings' norm precedes it
        self.attn_norm = LayerNorm(hidden, eps, bias=norm_bias) if index else None
        self.attn = nn.Module()
        self.attn.Wqkv = QKVParallelLinear(hidden, head_dim, heads, heads, bias=config.get("attention_bias", False))
        self.attn.Wo = RowParallelLinear(hidden, hidden, bias=config.get("attention_bias", False))
        self.num_heads, self.head_dim = self.attn.Wqkv.num_heads, head_dim
        self.rope = rope
        self.attention = EncoderAttention(self.num_heads, head_dim, window=window)
        self.mlp_norm = LayerNorm(hidden, eps, bias=norm_bias)
        self.mlp = nn.Module()
        self.mlp.Wi = MergedColumnParallelLinear(hidden, [config["intermediate_size"]] * 2, bias=bias)  # act, gate
        self.mlp.Wo = RowParallelLinear(config["intermediate_size"], hidden, bias=bias)
        self.act = activation(config.get("hidden_activation", "gelu"))

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(hidden) if self.attn_norm is not None else hidden
        q, k, v = self.attn.Wqkv(x).split(self.num_heads * self.head_dim, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)
        q, k = self.rope(batch, q.reshape(shape), k.reshape(shape))
        hidden = hidden + self.attn.Wo(self.attention(batch, q, k, v.reshape(shape)))
        gated, gate = self.mlp.Wi(self.mlp_norm(hidden)).chunk(2, dim=-1)
        return hidden + self.mlp.Wo(self.act(gated) * gate)


class ModernBertEncoder(nn.Module):
    """A ModelPipeline over the encoder, named as HF checkpoints name it (``model.`` prefix optional)."""

    can_generate = False
    is_causal = False

    def __init__(self, config: dict, ctx: BuildContext) -> None:
        super().__init__()
        validate_config(config, ctx)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        eps, norm_bias = config.get("norm_eps", 1e-5), config.get("norm_bias", False)
        self.config = config
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = VocabParallelEmbedding(config["vocab_size"], hidden)
        self.embeddings.norm = LayerNorm(hidden, eps, bias=norm_bias)
        types = layer_types(config)
        ropes = {kind: RotaryEmbedding(hidden // heads, hidden // heads, ctx.max_model_len, rope_theta(config, kind))
                 for kind in set(types)}
        window = int(config.get("local_attention", 128)) // 2
        self.layers = nn.ModuleList(
            ModernBertLayer(config, index, ropes[kind], window if kind == "sliding_attention" else None)
            for index, kind in enumerate(types))
        self.final_norm = LayerNorm(hidden, eps, bias=norm_bias)
        self.num_labels = num_labels(config)
        self.head = None
        if self.num_labels:
            self.head = nn.Module()
            self.head.dense = ReplicatedLinear(hidden, hidden, bias=config.get("classifier_bias", False))
            self.head.norm = LayerNorm(hidden, eps, bias=norm_bias)
            self.head_act = activation(config.get("classifier_activation", "gelu"))
            self.classifier = ReplicatedLinear(hidden, self.num_labels, bias=True)

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(0, self.layers[0].num_heads, self.layers[0].head_dim)  # each sequence is read whole

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if kv_caches:
            raise ValueError(f"an encoder keeps no KV cache, got {len(kv_caches)}")

    def forward(self, batch: ForwardBatch, intermediate: object = None) -> torch.Tensor:
        ids = batch.input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1)  # no token types: a pair's types are dropped
        hidden = self.embeddings.norm(self.embeddings.tok_embeddings(ids))
        for layer in self.layers:
            hidden = layer(batch, hidden)
        return self.final_norm(hidden[batch.logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            raise RuntimeError("this encoder has no classification head: it only embeds")
        return self.classifier(self.head.norm(self.head_act(self.head.dense(hidden)))).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in pairs:
                name = name.removeprefix("model.")
                if self.head is None and name.startswith(("head.", "decoder.", "classifier.")):
                    continue  # a masked-LM or classification head: not used to embed
                yield name, tensor

        # Wqkv and Wi are fused in the checkpoint too: their layers split them into projections for each rank
        load_named_weights(self, renamed(weights), stacked=(), ignore=("position_ids",))


def num_labels(config: dict) -> int:
    if not any(str(name).endswith("ForSequenceClassification") for name in config.get("architectures") or []):
        return 0
    return int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)


def validate_config(config: dict, ctx: BuildContext) -> None:
    """Reject what this pipeline would otherwise ignore."""
    check_positive_fields(config, _SIZE_FIELDS)
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ValueError(f"config.json: hidden_size {config['hidden_size']} is not a multiple of "
                         f"num_attention_heads {config['num_attention_heads']}")
    for kind in set(layer_types(config)):
        rope_theta(config, kind)
    if num_labels(config) and config.get("classifier_pooling", "cls") != "cls":
        raise ValueError(f"config.json: classifier_pooling {config['classifier_pooling']!r} is not supported by the "
                         "modernbert pipeline (supported: cls)")
    for field in ("hidden_activation", "classifier_activation"):
        activation(config.get(field, "gelu"))
    if ctx.max_model_len > config["max_position_embeddings"]:
        raise ValueError(f"max_model_len {ctx.max_model_len} exceeds max_position_embeddings "
                         f"{config['max_position_embeddings']}")
    if ctx.rank.pp_size > 1:
        raise ValueError("parallel.pipeline_parallel_size: the modernbert pipeline runs on one pipeline stage")


def build(hf_config: dict, ctx: BuildContext) -> ModernBertEncoder:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return ModernBertEncoder(hf_config, ctx)
