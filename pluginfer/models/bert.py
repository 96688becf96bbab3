"""Encoder pipelines: BERT and (XLM-)RoBERTa, bare (``*Model``: embeddings) or with a sequence-classification head
(``*ForSequenceClassification``: cross-encoders, which score).

Post-norm blocks (``LayerNorm(x + attention(x))``, then ``LayerNorm(h + ffn(h))``), absolute position embeddings
and token types; attention is bidirectional within each sequence (``layers/encoder_attention.py``), so the engine
reads each prompt whole in one step (``is_causal`` False) and no KV cache is kept. RoBERTa numbers positions
from ``pad_token_id + 1`` and its head is ``out_proj(tanh(dense(h)))`` on the first token; BERT's is
``classifier(tanh(pooler.dense(h)))``. Token types reach the model in the token ids' high bits
(``core/batch.py``'s ``TOKEN_TYPE_SHIFT``): a sentence pair's second text is type 1 where the tokenizer says so.
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
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pluginfer.layers.norm import LayerNorm
from pluginfer.layers.weights import load_named_weights

ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
_SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                "max_position_embeddings")
_STACKED = ((".attention.qkv_proj.", ".attention.self.query.", "q"),
            (".attention.qkv_proj.", ".attention.self.key.", "k"),
            (".attention.qkv_proj.", ".attention.self.value.", "v"))


def is_roberta(config: dict) -> bool:
    return config.get("model_type") in ROBERTA_TYPES or any(
        "Roberta" in str(name) or "Camembert" in str(name) for name in config.get("architectures") or [])


def position_offset(config: dict) -> int:
    """RoBERTa's first position is ``pad_token_id + 1`` (its rows below are never a position)."""
    return int(config.get("pad_token_id") or 0) + 1 if is_roberta(config) else 0


class BertEmbeddings(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = VocabParallelEmbedding(config["vocab_size"], hidden)
        self.position_embeddings = VocabParallelEmbedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = VocabParallelEmbedding(config.get("type_vocab_size", 2), hidden)
        self.LayerNorm = LayerNorm(hidden, config.get("layer_norm_eps", 1e-12))
        self.offset = position_offset(config)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        ids = batch.input_ids
        token_types, ids = ids >> TOKEN_TYPE_SHIFT, ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        hidden = self.word_embeddings(ids) + self.token_type_embeddings(token_types)
        return self.LayerNorm(hidden + self.position_embeddings(batch.positions + self.offset))


class BertLayer(nn.Module):
    """``h = LN(x + o(attn(qkv(x))))``, then ``LN(h + down(act(up(h))))``; named as HF names them."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim, eps = hidden // heads, config.get("layer_norm_eps", 1e-12)
        self.attention = nn.Module()
        self.attention.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True)
        self.attention.output = nn.Module()
        self.attention.output.dense = RowParallelLinear(hidden, hidden, bias=True)
        self.attention.output.LayerNorm = LayerNorm(hidden, eps)
        self.num_heads, self.head_dim = self.attention.qkv_proj.num_heads, head_dim
        self.attn = EncoderAttention(self.num_heads, head_dim)
        self.intermediate = nn.Module()
        self.intermediate.dense = ColumnParallelLinear(hidden, config["intermediate_size"], bias=True)
        self.act = activation(config.get("hidden_act", "gelu"))
        self.output = nn.Module()
        self.output.dense = RowParallelLinear(config["intermediate_size"], hidden, bias=True)
        self.output.LayerNorm = LayerNorm(hidden, eps)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        width = self.num_heads * self.head_dim
        q, k, v = self.attention.qkv_proj(hidden).split(width, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)
        out = self.attn(batch, q.reshape(shape), k.reshape(shape), v.reshape(shape))
        hidden = self.attention.output.LayerNorm(self.attention.output.dense(out), hidden)[0]
        ffn = self.output.dense(self.act(self.intermediate.dense(hidden)))
        return self.output.LayerNorm(ffn, hidden)[0]


class ClassificationHead(nn.Module):
    """``out(tanh(dense(h)))`` of the first token: BERT's ``pooler.dense`` + ``classifier``, RoBERTa's
    ``classifier.dense`` + ``classifier.out_proj``."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(hidden, hidden, bias=True)
        self.out_proj = ReplicatedLinear(hidden, num_labels, bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(hidden)))


class BertEncoder(nn.Module):
    """A ModelPipeline over the encoder: ``forward`` returns final hidden states of ``batch.logits_indices``;
    a classifier's ``compute_logits`` turns the first token's into ``num_labels`` scores."""

    can_generate = False
    is_causal = False

    def __init__(self, config: dict, ctx: BuildContext) -> None:
        super().__init__()
        validate_config(config, ctx)
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(config) for _ in range(config["num_hidden_layers"]))
        self.num_labels = num_labels(config)
        self.head = ClassificationHead(config["hidden_size"], self.num_labels) if self.num_labels else None

    def kv_cache_spec(self) -> KVCacheSpec:
        layer = self.encoder.layer[0]
        return KVCacheSpec(0, layer.num_heads, layer.head_dim)  # each sequence is read whole: nothing to keep

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if kv_caches:
            raise ValueError(f"an encoder keeps no KV cache, got {len(kv_caches)}")

    def forward(self, batch: ForwardBatch, intermediate: object = None) -> torch.Tensor:
        hidden = self.embeddings(batch)
        for layer in self.encoder.layer:
            hidden = layer(batch, hidden)
        return hidden[batch.logits_indices]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            raise RuntimeError("this encoder has no classification head: it only embeds")
        return self.head(hidden).float()

    def weight_routes(self) -> tuple:
        """The fused query/key/value projection's routes (a checkpoint's and a LoRA adapter's names)."""
        return _STACKED

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        bert = not is_roberta(self.config)

        def renamed(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in pairs:
                name = name.removeprefix("bert.").removeprefix("roberta.")
                if name.startswith("pooler.") and (self.head is None or not bert):
                    # a bare encoder's pooler: sentence-transformers pools the tokens instead
                    continue
                if name.startswith("pooler.dense."):  # BERT's head begins with its pooler
                    name = "head.dense." + name.removeprefix("pooler.dense.")
                elif bert and name.startswith("classifier."):
                    name = "head.out_proj." + name.removeprefix("classifier.")
                elif name.startswith("classifier."):
                    name = "head." + name.removeprefix("classifier.")
                elif name.startswith(("cls.", "lm_head.")) and self.head is None:
                    continue  # a masked-LM head: not used to embed
                yield name.replace(".gamma", ".weight").replace(".beta", ".bias"), tensor

        load_named_weights(self, renamed(weights), stacked=self.weight_routes(), ignore=("position_ids",))


def num_labels(config: dict) -> int:
    """0 for a bare encoder; the classifier's outputs for ``*ForSequenceClassification``."""
    if not any(str(name).endswith("ForSequenceClassification") for name in config.get("architectures") or []):
        return 0
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    return int(labels)


def validate_config(config: dict, ctx: BuildContext) -> None:
    """Reject what this pipeline would otherwise ignore."""
    check_positive_fields(config, _SIZE_FIELDS)
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ValueError(f"config.json: hidden_size {config['hidden_size']} is not a multiple of "
                         f"num_attention_heads {config['num_attention_heads']}")
    kind = config.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"config.json: position_embedding_type {kind!r} is not supported by the bert pipeline "
                         "(supported: absolute)")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise ValueError("config.json: is_decoder / add_cross_attention: the bert pipeline serves encoders only")
    activation(config.get("hidden_act", "gelu"))  # names the field if unsupported
    usable = config["max_position_embeddings"] - position_offset(config)
    if ctx.max_model_len > usable:
        raise ValueError(f"max_model_len {ctx.max_model_len} exceeds the {usable} positions of this encoder "
                         f"(max_position_embeddings {config['max_position_embeddings']}); set --max-model-len")
    if ctx.rank.pp_size > 1:
        raise ValueError("parallel.pipeline_parallel_size: the bert pipeline runs on one pipeline stage")


def build(hf_config: dict, ctx: BuildContext) -> BertEncoder:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return BertEncoder(hf_config, ctx)
