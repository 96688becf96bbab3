"""Scores: how a model rates a pair of texts (``LLM.score``, ``/v1/score``, ``/v1/rerank``), as
sentence-transformers and vLLM do.

A cross-encoder (``*ForSequenceClassification`` with ``num_labels``) encodes the pair as its tokenizer does and
scores the first token's logit through the saved ``activation_fn`` (sigmoid by default); a causal LM reranker
(Qwen3-Reranker's recipe) scores ``sigmoid(logit(true) - logit(false))`` at the last position, the tokens named
by ``--score-tokens`` or config.json's ``classifier_from_token``. The worker returns the scored rows' logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pluginfer.core.batch import TOKEN_TYPE_SHIFT

_IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity", "Identity")
_SIGMOID = ("torch.nn.modules.activation.Sigmoid", "torch.nn.Sigmoid", "Sigmoid")


def is_causal(pipeline: Any) -> bool:
    """``ModelPipeline.is_causal`` (API 5, optional: True when absent)."""
    return bool(getattr(pipeline, "is_causal", True))


def score_tokens_of(config: Any, hf_config: dict) -> list[str] | None:
    """The (false, true) tokens of a yes/no reranker: the config's ``score_tokens``, else config.json's
    ``classifier_from_token``; None: the model does not score from token logits."""
    tokens = config.score_tokens or hf_config.get("classifier_from_token")
    return list(tokens) if tokens else None


def scores_pooled_rows(pipeline: Any, config: Any, hf_config: dict) -> bool:
    """Whether this model's pooled rows are scored (their logits come back instead of hidden states)."""
    scored = bool(getattr(pipeline, "num_labels", 0)) or bool(score_tokens_of(config, hf_config))
    if scored and config.parallel.pipeline_parallel_size > 1:
        raise ValueError("parallel.pipeline_parallel_size: a model that scores runs on one pipeline stage")
    return scored


@dataclass(frozen=True)
class Scorer:
    """How this model turns a scored row's logits into one score; ``problem``: why it cannot score."""

    method: str = "last"  # the pooled row: "cls" (an encoder's first token) or "last"
    problem: str | None = None
    pair: tuple[int, int] | None = None  # (false, true) token ids of a yes/no reranker
    sigmoid: bool = True

    def check(self) -> None:
        if self.problem is not None:
            raise ValueError(self.problem)

    def score_of(self) -> Callable[[Any], float]:
        """The function of one scored row's logits that gives its score (run by the engine, which has torch)."""
        import torch

        pair, sigmoid = self.pair, self.sigmoid
        if pair is not None:
            return lambda logits: float(torch.sigmoid(logits[pair[1]] - logits[pair[0]]))
        return lambda logits: float(torch.sigmoid(logits[0])) if sigmoid else float(logits[0])


def _activation(model_path: Path, hf_config: dict) -> tuple[str | None, str]:
    """The CrossEncoder's saved ``activation_fn`` and the file that says it (None: not saved, a sigmoid)."""
    settings = model_path / "config_sentence_transformers.json"
    if settings.is_file():
        try:
            saved = json.loads(settings.read_text()).get("activation_fn")
        except (OSError, ValueError, AttributeError):
            saved = None
        if saved is not None:
            return saved, settings.name
    return (hf_config.get("sentence_transformers") or {}).get("activation_fn"), "config.json"


def read_scorer(pipeline: Any, config: Any, hf_config: dict, tokenizer: Any, model_path: Path) -> Scorer:
    """This model's scorer, or one whose ``problem`` says why it cannot score."""
    labels = int(getattr(pipeline, "num_labels", 0) or 0)
    tokens = score_tokens_of(config, hf_config)
    if labels:
        if labels != 1:
            return Scorer(problem=f"this classifier has num_labels {labels}; a score needs one label")
        activation, source = _activation(model_path, hf_config) if model_path.is_dir() else (None, "")
        if activation is not None and activation not in _IDENTITY + _SIGMOID:
            return Scorer(problem=f"{source}: activation_fn {activation!r} is not supported (supported: Sigmoid, "
                          "Identity)")
        return Scorer(method="cls", sigmoid=activation not in _IDENTITY)
    if tokens:
        if len(tokens) != 2:
            return Scorer(problem=f"score_tokens: give two tokens (false, true), got {tokens}")
        ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
        unknown = [token for token, id_ in zip(tokens, ids) if id_ is None or id_ == tokenizer.unk_token_id]
        if unknown:
            return Scorer(problem=f"score_tokens: {unknown} not in the tokenizer's vocabulary")
        if not getattr(pipeline, "can_generate", True):
            return Scorer(problem="score_tokens: this checkpoint has no LM head to score tokens with")
        return Scorer(method="last", pair=(ids[0], ids[1]))
    return Scorer(problem="this model cannot score: scores come from a cross-encoder (a *ForSequenceClassification "
                  "checkpoint with one label) or a causal LM served with --score-tokens (e.g. no, yes: "
                  "Qwen3-Reranker's recipe)")


def uses_token_types(hf_config: dict) -> bool:
    """Whether the model reads token types (BERT's ``type_vocab_size`` 2; XLM-RoBERTa's is 1, a decoder has none)."""
    return int(hf_config.get("type_vocab_size") or 0) > 1


def encode_pair(tokenizer: Any, text_1: str, text_2: str, token_types: bool) -> list[int]:
    """The pair's token ids as the tokenizer encodes a pair (``[CLS] a [SEP] b [SEP]``, or a decoder's plain
    concatenation), with each token's type in the high bits where the model reads types."""
    encoding = tokenizer.backend_tokenizer.encode(text_1, text_2, add_special_tokens=True)
    if not token_types:
        return list(encoding.ids)
    return [token_type << TOKEN_TYPE_SHIFT | token for token, token_type in zip(encoding.ids, encoding.type_ids)]


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against each text_2 (1:N), or the two lists side by side (N:N)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise ValueError(f"{name}: give at least one text")
        bad = [index for index, text in enumerate(texts) if not isinstance(text, str)]
        if bad:
            raise ValueError(f"{name}: item {bad[0]} is not a string")
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                         "as text_2")
    return list(zip(first, second))
