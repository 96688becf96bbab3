"""The scaffolding every decoder-only family shares: the layer stack, the LM head, weight loading.

A family supplies its decoder layer (``layer(batch, hidden, residual) -> (hidden, residual)``,
pre-norm with the residual add fused into the next norm) and, if it differs, its weight routing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import IntermediateTensors, KVCacheSpec, stage_layers
from pluginfer.engine.pooling import is_backbone_only
from pluginfer.layers.attention import bind_kv_caches
from pluginfer.layers.context import current_context, has_context
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


class MissingLayer(nn.Module):
    """A decoder layer that another pipeline stage holds: no parameters, never called."""


class DecoderStack(nn.Module):
    """``embed_tokens`` -> ``layers`` -> ``norm`` (only on the rows that are sampled).

    ``embed_scale``: multiply the embeddings by it (Gemma's ``sqrt(hidden_size)``), rounded to the
    embeddings' dtype first as transformers does.

    Under pipeline parallelism (the build context's ``rank.pp_size > 1``) only this stage's layers
    are built (the others are ``MissingLayer``s, so checkpoint names keep their indices); the first
    stage embeds, the last one holds the final norm, and the embedding too when the head is tied.
    """

    def __init__(self, config: dict, make_layer: Callable[[int], nn.Module], eps_default: float = 1e-6,
                 norm: nn.Module | None = None, embed_scale: float | None = None) -> None:
        super().__init__()
        rank = current_context().rank if has_context() else None
        num_layers = config["num_hidden_layers"]
        pp_size, pp_rank = (rank.pp_size, rank.pp_rank) if rank is not None else (1, 0)
        self.layer_range = stage_layers(num_layers, pp_size, pp_rank)
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"]) \
            if self.is_first or self.is_last else None
        self.embed_scale = embed_scale
        self.layers = nn.ModuleList(make_layer(index) if index in self.layer_range else MissingLayer()
                                    for index in range(num_layers))
        if not self.is_last:
            self.norm = None
        else:
            self.norm = norm if norm is not None else RMSNorm(config["hidden_size"],
                                                              config.get("rms_norm_eps", eps_default))

    def held_layers(self) -> list[nn.Module]:
        """This pipeline stage's decoder layers, in order."""
        return [self.layers[index] for index in self.layer_range]

    def forward(self, batch: ForwardBatch,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if self.is_first:
            hidden, residual = self.embed_tokens(batch.input_ids), None
            if self.embed_scale is not None:
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        else:
            hidden, residual = intermediate.tensors["hidden"], intermediate.tensors["residual"]
        for index in self.layer_range:
            hidden, residual = self.layers[index](batch, hidden, residual)
        if not self.is_last:
            return IntermediateTensors({"hidden": hidden, "residual": residual})
        rows = batch.logits_indices
        return self.norm(hidden[rows] + residual[rows])


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def held_by_stage(name: str, stack: DecoderStack, head: str = "lm_head.") -> bool:
    """Whether checkpoint tensor ``name`` belongs to this pipeline stage's part of the model."""
    match = _LAYER_INDEX.search(name)
    if match is not None:
        return int(match.group(1)) in stack.layer_range
    if ".embed_tokens." in f".{name}":
        return stack.embed_tokens is not None
    if name.startswith(head) or ".norm." in f".{name}":
        return stack.is_last
    return True


class CausalLM(nn.Module):
    """A ModelPipeline: ``model`` (a DecoderStack) and ``lm_head``, named as in HF checkpoints.

    A bare decoder checkpoint (``Qwen3Model``, as sentence-transformers saves an embedding model) has
    no ``model.`` prefix in its tensor names and no LM head: it is built without one and only embeds.
    Qwen3-Embedding's hub checkpoints say ``Qwen3ForCausalLM`` but are laid out the same way: names
    without the prefix are read as the decoder's, and when such a checkpoint brings no untied head,
    ``can_generate`` is False (the engine then only embeds with it).
    """

    # ModelPipeline.can_generate (API 3): False once loaded without an LM head
    can_generate = True

    def __init__(self, config: dict, model: DecoderStack, tied_by_default: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.backbone_only = is_backbone_only(config)
        self.tied = bool(config.get("tie_word_embeddings", tied_by_default)) and not self.backbone_only
        has_head = model.is_last and not self.backbone_only
        self.lm_head = LMHead(config["vocab_size"], config["hidden_size"]) if has_head else None
        if has_head and self.tied:
            self.lm_head.tie(self.model.embed_tokens)
        if not model.is_first and not (has_head and self.tied):
            self.model.embed_tokens = None  # a middle or untied last stage never embeds

    def kv_cache_spec(self) -> KVCacheSpec:
        held = self.model.held_layers()
        attn = held[0].self_attn
        return KVCacheSpec(len(held), attn.num_kv_heads, attn.head_dim)

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        bind_kv_caches(self.model.held_layers(), kv_caches)

    def forward(self, batch: ForwardBatch,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(batch, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("this checkpoint is a bare decoder without an LM head: it can only embed")
        return self.lm_head(hidden).float()

    def weight_routes(self) -> tuple:
        """(fused parameter part, checkpoint part, shard id) routes; llama-style by default."""
        return LLAMA_STACKED

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen = {"bare": False, "head": False}

        def as_decoder_names(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            """"layers.0...", "embed_tokens.weight", "norm.weight" (a bare decoder's names) are the model's."""
            for name, tensor in pairs:
                if name.startswith("lm_head."):
                    seen["head"] = True
                elif not name.startswith("model."):
                    seen["bare"] = True
                    name = f"model.{name}"
                yield name, tensor

        weights = as_decoder_names(weights)
        if self.tied:
            # a tied head has no weight of its own; some checkpoints store a copy anyway
            weights = ((name, tensor) for name, tensor in weights if name != "lm_head.weight")
        weights = ((name, tensor) for name, tensor in weights if held_by_stage(name, self.model))
        head_optional = self.tied or self.lm_head is None or not self.model.is_last
        load_named_weights(self, weights, stacked=self.weight_routes(), optional=("lm_head.",))
        if self.tied or seen["head"] or self.backbone_only:
            self.can_generate = not self.backbone_only
        elif seen["bare"]:
            # an embedding checkpoint's decoder (Qwen3-Embedding-8B): no head to generate with
            self.can_generate, self.lm_head = False, None
        elif not head_optional:
            raise KeyError("checkpoint is missing 1 tensor(s): lm_head.weight")
        else:  # a stage without the head: the checkpoint has none either
            self.can_generate = False


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
