"""Embeddings: how a checkpoint pools its hidden states, and one request's pooling as its prompt is read.

The method (last token, mean, CLS) and normalization come from the checkpoint's sentence-transformers files
(``modules.json``, the Pooling module's ``config.json``), its ``default_prompt_name`` prompt too; without them
asking for embeddings is an error unless ``--pooling`` names a method (then L2-normalized, as vLLM). Matryoshka
``dimensions`` only where the config says the model was trained for it. A request runs as a prompt that samples
nothing: its prefill chunks batch with everything else and return the rows its pooling needs
(``PoolingState.rows``), which ``PoolingState.add`` folds in. Scores (``engine/scoring.py``) pool the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # torch is imported where a state pools: importing the params stays cheap
    import torch

TASKS = ("embed", "score")
POOLING_METHODS = ("last", "mean", "cls")  # what PoolerConfig.method and PoolingState.method may be
# sentence-transformers' pooling modes -> ours: the flags of its Pooling config.json before v6 and the
# ``pooling_mode`` names of v6; the other modes (max, mean_sqrt_len_tokens, weightedmean) are refused by name.
_ST_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_max_tokens": None, "pooling_mode_mean_sqrt_len_tokens": None,
             "pooling_mode_weightedmean_tokens": None}
_ST_MODES = {"lasttoken": "last", "mean": "mean", "mean_tokens": "mean", "cls": "cls", "cls_token": "cls"}
# Module types by their class name (modules.json spells the module path differently across versions).
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass
class PoolingParams:
    """What one embedding request asks for (``LLM.embed``, ``/v1/embeddings``)."""

    # keep the first ``dimensions`` values, renormalized (Matryoshka models only)
    dimensions: int | None = None
    # "score": the prompt is a pair (``LLM.score``), its result one score
    task: str = "embed"

    # one result per prompt (the engine's clients read ``params.n``)
    n: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions: must be an integer >= 1, got {self.dimensions!r}")
        if self.task not in TASKS:
            raise ValueError(f"PoolingParams.task: must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.task == "score" and self.dimensions is not None:
            raise ValueError("PoolingParams.dimensions: a score has no dimensions")


@dataclass(frozen=True)
class PoolerConfig:
    """How this checkpoint turns hidden states into one embedding."""

    method: str  # "last", "mean" or "cls"
    normalize: bool  # L2-normalize the pooled vector
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: any size up to hidden_size (if matryoshka)
    matryoshka: bool = False
    # why this checkpoint cannot embed (then the fields above are placeholders)
    problem: str | None = None
    # config_sentence_transformers.json's default prompt, put before every text input
    default_prompt: str = ""

    def check(self, params: PoolingParams) -> None:
        """Raise ValueError naming what is wrong for this model (no pooling config, a bad ``dimensions``)."""
        if self.problem is not None:
            raise ValueError(self.problem)
        dims = params.dimensions
        if dims is None:
            return
        if not self.matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka truncation (its config.json "
                             "sets neither is_matryoshka nor matryoshka_dimensions); leave dimensions out")
        if self.matryoshka_dimensions is not None and dims not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions: must be one of {list(self.matryoshka_dimensions)}, got {dims}")
        if dims > self.hidden_size:
            raise ValueError(f"dimensions: must be at most the embedding size {self.hidden_size}, got {dims}")


def read_pooler_config(model_path: Path, hf_config: dict, method: str | None = None) -> PoolerConfig:
    """The pooling of the checkpoint at ``model_path``, from its sentence-transformers files; ``method``
    (``--pooling``) replaces their mode, or stands for them where there are none (then normalized)."""
    pooler = _read_pooler_files(model_path, hf_config)
    if method is None:
        return pooler
    if method not in POOLING_METHODS:
        raise ValueError(f"pooling: must be one of {', '.join(POOLING_METHODS)}, got {method!r}")
    if pooler.problem is None:
        return PoolerConfig(method, pooler.normalize, pooler.hidden_size, pooler.matryoshka_dimensions,
                            pooler.matryoshka, default_prompt=pooler.default_prompt)
    return PoolerConfig(method, True, pooler.hidden_size, pooler.matryoshka_dimensions, pooler.matryoshka)


def _read_pooler_files(model_path: Path, hf_config: dict) -> PoolerConfig:
    hidden = int(hf_config.get("hidden_size") or 0)
    matryoshka_dims = hf_config.get("matryoshka_dimensions")
    matryoshka = bool(hf_config.get("is_matryoshka")) or bool(matryoshka_dims)
    dims = tuple(int(d) for d in matryoshka_dims) if matryoshka_dims else None

    def refuse(problem: str) -> PoolerConfig:
        return PoolerConfig("last", False, hidden, dims, matryoshka, problem=problem)

    if model_path.suffix == ".gguf" or not model_path.is_dir():
        return refuse(f"this model ({model_path.name}) has no sentence-transformers pooling config: embeddings "
                      "need a checkpoint directory with modules.json and a Pooling module's config.json")
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return refuse("this model has no pooling config: modules.json is missing (sentence-transformers' "
                      "module list, naming a Pooling module whose config.json says last-token, mean or CLS "
                      "pooling); embeddings are served only for checkpoints that say how to pool")
    try:
        modules = json.loads(modules_file.read_text())
        types = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules]
    except (ValueError, AttributeError, TypeError) as exc:
        return refuse(f"modules.json: not a sentence-transformers module list: {exc}")
    kinds = [kind.rpartition(".")[2] for kind, _ in types]
    if kinds[:2] != [_TRANSFORMER, _POOLING] or kinds[2:] not in ([], [_NORMALIZE]):
        return refuse(f"modules.json: modules {', '.join(kinds)} are not supported (supported: "
                      f"{_TRANSFORMER}, {_POOLING}, then optionally {_NORMALIZE})")
    # Messages name files inside the checkpoint, never the server's path: clients read them (a 400).
    pooling_file, shown = model_path / types[1][1] / "config.json", f"{types[1][1]}/config.json"
    try:
        pooling = json.loads(pooling_file.read_text())
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else exc
        return refuse(f"{shown}: cannot read the Pooling module's config: {why}")
    if pooling.get("include_prompt") is False:
        return refuse(f"{shown}: include_prompt false (pooling that leaves out the instruction) is not "
                      "supported")
    method, problem = _pooling_method(pooling)
    if problem is not None:
        return refuse(f"{shown}: {problem}")
    dimension = pooling.get("embedding_dimension", pooling.get("word_embedding_dimension"))
    if dimension is not None and hidden and int(dimension) != hidden:
        return refuse(f"{shown}: embedding dimension {dimension} is not the model's hidden_size {hidden}")
    default_prompt, problem = _default_prompt(model_path / "config_sentence_transformers.json")
    if problem is not None:
        return refuse(problem)
    return PoolerConfig(method, kinds[2:] == [_NORMALIZE], hidden, dims, matryoshka, default_prompt=default_prompt)


def _default_prompt(path: Path) -> tuple[str, str | None]:
    """The prompt sentence-transformers puts before every text when no other is named (``default_prompt_name``
    among ``prompts``; usually none: Qwen3-Embedding's instructions are the caller's to add)."""
    if not path.is_file():
        return "", None
    try:
        settings = json.loads(path.read_text())
        name, prompts = settings.get("default_prompt_name"), settings.get("prompts") or {}
    except (OSError, ValueError, AttributeError) as exc:
        return "", f"{path.name}: cannot read it: {exc.strerror if isinstance(exc, OSError) else exc}"
    if name is None:
        return "", None
    if not isinstance(prompts, dict) or not isinstance(prompts.get(name), str):
        return "", f"{path.name}: default_prompt_name {name!r} names no prompt in prompts"
    return prompts[name], None


def _pooling_method(pooling: dict) -> tuple[str, str | None]:
    """(our method, None) from a Pooling config.json, or ("", why it is not supported)."""
    supported = "lasttoken, mean or cls"
    if "pooling_mode" in pooling:
        mode = pooling["pooling_mode"]
        modes = mode if isinstance(mode, list) else [mode]
        if len(modes) != 1 or modes[0] not in _ST_MODES:
            return "", f"pooling_mode {mode!r} is not supported (supported: {supported})"
        return _ST_MODES[modes[0]], None
    chosen = [flag for flag in _ST_FLAGS if pooling.get(flag)]
    if len(chosen) != 1:
        return "", f"exactly one pooling_mode_* flag must be true, got {chosen or 'none'}"
    method = _ST_FLAGS[chosen[0]]
    if method is None:
        return "", f"{chosen[0]} is not supported (supported: {supported})"
    return method, None


@dataclass(eq=False)
class PoolingState:
    """One embedding request's pooling while its prompt is read (chunk by chunk, perhaps recomputed)."""

    method: str
    normalize: bool
    dimensions: int | None = None
    # an encoder's: read in one step, never from the prefix cache
    whole_prompt: bool = False
    score: Callable[[torch.Tensor], float] | None = None  # a score request's: the pooled row's logits -> its score
    total: torch.Tensor | None = None
    count: int = 0
    embedding: list[float] | None = None

    @property
    def uses_every_position(self) -> bool:
        """Mean and CLS pooling need hidden states of prompt positions a prefix-cache hit would skip (and an
        encoder's attention reads every position)."""
        return self.method != "last" or self.whole_prompt

    def rows(self, first: int, count: int, prompt_len: int) -> tuple[int, int]:
        """(offset in the chunk, rows) whose hidden states this chunk of positions ``first..`` must return."""
        if self.method == "mean":
            return 0, count
        if self.method == "cls":
            return (0, 1) if first == 0 else (0, 0)
        return (count - 1, 1) if first + count == prompt_len else (0, 0)

    def add(self, first: int, hidden: torch.Tensor) -> None:
        """Fold in the rows ``rows`` chose for the chunk starting at ``first`` (a recompute starts over)."""
        if first == 0 or self.total is None:
            self.total, self.count = None, 0
        if hidden.shape[0] == 0:
            return
        rows = hidden.float()
        if self.method == "mean":
            part = rows.sum(dim=0)
            self.total = part if self.total is None else self.total + part
            self.count += rows.shape[0]
        else:
            self.total, self.count = rows[-1].clone(), 1

    def finish(self) -> list[float]:
        """The embedding: pooled, truncated to ``dimensions``, then L2-normalized if the model normalizes."""
        if self.total is None:
            raise RuntimeError("pooling finished without any hidden state")
        vector = self.total / self.count if self.method == "mean" else self.total
        if self.score is not None:
            self.embedding, self.total = [self.score(vector)], None
            return self.embedding
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.normalize:
            from torch.nn.functional import normalize

            vector = normalize(vector, p=2, dim=0)
        self.embedding = vector.tolist()
        self.total = None
        return self.embedding


def is_backbone_only(hf_config: dict) -> bool:
    """A checkpoint of the bare decoder (``Qwen3Model``, ``LlamaModel``, as sentence-transformers saves
    one): no LM head, so it embeds and cannot generate."""
    names = hf_config.get("architectures") or []
    return bool(names) and all(str(name).endswith("Model") for name in names)
