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


class DecoderStack(nn.Module):
    """``embed_tokens`` -> ``layers`` -> ``norm`` (only on the rows that are sampled)."""

    def __init__(self, config: dict, make_layer: Callable[[int], nn.Module], eps_default: float = 1e-6,
                 norm: nn.Module | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(make_layer(index) for index in range(config["num_hidden_layers"]))
        self.norm = norm if norm is not None else RMSNorm(config["hidden_size"], config.get("rms_norm_eps", eps_default))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            hidden, residual = layer(batch, hidden, residual)
        rows = batch.logits_indices
        return self.norm(hidden[rows] + residual[rows])


class CausalLM(nn.Module):
    """A ModelPipeline: ``model`` (a DecoderStack) and ``lm_head``, named as in HF checkpoints."""

    def __init__(self, config: dict, model: DecoderStack) -> None:
        super().__init__()
        self.config = config
        self.model = model
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

    def weight_routes(self) -> tuple:
        """(fused parameter part, checkpoint part, shard id) routes; llama-style by default."""
        return LLAMA_STACKED

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.tied:  # a tied head has no weight of its own; some checkpoints store a copy anyway
            weights = ((name, tensor) for name, tensor in weights if name != "lm_head.weight")
        load_named_weights(self, weights, stacked=self.weight_routes(),
                           optional=("lm_head.",) if self.tied else ())


def check_positive_fields(config: dict, fields: Iterable[str]) -> None:
    for field in fields:
        if not isinstance(config.get(field), int) or config[field] <= 0:
            raise ValueError(f"config.json: {field} must be a positive integer, got {config.get(field)!r}")
