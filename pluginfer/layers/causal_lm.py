"""The scaffolding every decoder-only family shares: the layer stack, the LM head, weight loading.

A family supplies its decoder layer (``layer(batch, hidden, residual) -> (hidden, residual)``,
pre-norm with the residual add fused into the next norm) and, if it differs, its weight routing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import KVCacheSpec
from pluginfer.layers.embedding import LMHead, VocabParallelEmbedding
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.weights import LLAMA_STACKED, load_named_weights


def add_and_norm(norm: nn.Module, hidden: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(hidden + residual), hidden + residual)`` with the add fused into the norm; the first
    layer (``residual`` None) starts the residual stream with ``hidden``."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class PreNormDecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``+ ffn(norm(x))``; each norm adds the residual it is handed (fused).

    Subclasses build ``self_attn``, ``input_layernorm``, ``post_attention_layernorm`` and the
    feed-forward block, and override ``feed_forward`` when it is not ``self.mlp``.
    """

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(batch, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class DecoderStack(nn.Module):
    """``embed_tokens`` -> ``layers`` -> ``norm`` (only on the rows that are sampled).

    ``embed_scale``: multiply the embeddings by it (Gemma's ``sqrt(hidden_size)``), rounded to the
    embeddings' dtype first as transformers does.
    """

    def __init__(self, config: dict, make_layer: Callable[[int], nn.Module], eps_default: float = 1e-6,
                 norm: nn.Module | None = None, embed_scale: float | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.embed_scale = embed_scale
        self.layers = nn.ModuleList(make_layer(index) for index in range(config["num_hidden_layers"]))
        self.norm = norm if norm is not None else RMSNorm(config["hidden_size"], config.get("rms_norm_eps", eps_default))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(batch.input_ids), None
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(batch, hidden, residual)
        rows = batch.logits_indices
        return self.norm(hidden[rows] + residual[rows])


class CausalLM(nn.Module):
    """A ModelPipeline: ``model`` (a DecoderStack) and ``lm_head``, named as in HF checkpoints."""

    def __init__(self, config: dict, model: DecoderStack, tied_by_default: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = LMHead(config["vocab_size"], config["hidden_size"])
        self.tied = bool(config.get("tie_word_embeddings", tied_by_default))
        if self.tied:
            self.lm_head.tie(self.model.embed_tokens)

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.model.layers[0].self_attn
        return KVCacheSpec(len(self.model.layers), attn.num_kv_heads, attn.head_dim)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def weight_routes(self) -> tuple:
        """(fused parameter part, checkpoint part, shard id) routes; llama-style by default."""
        return LLAMA_STACKED

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.tied:  # a tied head has no weight of its own; some checkpoints store a copy anyway
            weights = ((name, tensor) for name, tensor in weights if name != "lm_head.weight")
        load_named_weights(self, weights, stacked=self.weight_routes(),
                           optional=("lm_head.",) if self.tied else ())


DECODER_SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


def check_positive_fields(config: dict, fields: Iterable[str]) -> None:
    for field in fields:
        if not isinstance(config.get(field), int) or config[field] <= 0:
            raise ValueError(f"config.json: {field} must be a positive integer, got {config.get(field)!r}")


def check_activation(config: dict, pipeline: str, supported: tuple[str, ...]) -> None:
    if config.get("hidden_act", "silu") not in supported:
        raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported by the {pipeline} "
                         f"pipeline (supported: {', '.join(supported)})")


def check_kv_heads(config: dict) -> None:
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
