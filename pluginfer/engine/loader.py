"""Find a checkpoint (a local path a checkpoint format claims, or a hub id) and stream its weights.

Which format reads a path is the registry's answer (``checkpoint_format`` plugins: safetensors
directories and GGUF files are built in), never a test of the path here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pluginfer.core.checkpoint import Checkpoint, CheckpointError, ModelNotFoundError
from pluginfer.core.registry import Registry, get_registry

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}


# Any of these in a model directory makes a tokenizer transformers can load without running code.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def _looks_like_path(model: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else is meant as a local path."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local checkpoint directory for ``model``: the directory itself, or a hub snapshot."""
    path = Path(model).expanduser()
    if path.exists():
        if get_registry().claiming("checkpoint_format", path) is None:
            raise _unclaimed(path, get_registry())
        return path
    if _looks_like_path(model):
        raise ModelNotFoundError(f"model path {path} does not exist")
    return _download(model, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ModelNotFoundError(f"{repo_id!r} is not a local directory and huggingface_hub is missing") from exc
    try:
        snapshot = snapshot_download(
            repo_id, revision=revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
        )
    except Exception as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True")
        hint = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached or has no such repository"
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local directory and could not be downloaded ({hint}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            f"Pass a local checkpoint directory, or --model demo for the built-in demo model."
        ) from None
    return Path(snapshot)


def open_checkpoint(path: Path, registry: Registry | None = None) -> Checkpoint:
    """``path`` opened by the checkpoint format that claims it (the highest priority of those that do); a
    GGUF file's metadata, which holds the whole vocabulary, is parsed once for the config and the weights."""
    registry = registry or get_registry()
    spec = registry.claiming("checkpoint_format", path)
    if spec is None:
        raise _unclaimed(path, registry)
    return registry.load("checkpoint_format", spec.name)(path)


def _unclaimed(path: Path, registry: Registry) -> ModelNotFoundError:
    formats = ", ".join(spec.name for spec in registry.specs("checkpoint_format")) or "(none)"
    what = "a directory" if path.is_dir() else "a file"
    return ModelNotFoundError(f"no checkpoint format reads {path}, which is {what} (formats: {formats}; a Hugging "
                              "Face directory needs a config.json, a GGUF file the .gguf suffix); see `pluginfer plugins`")


def read_hf_config(path: Path | Checkpoint) -> dict:
    """The checkpoint's Hugging Face config; a path is opened first."""
    return (open_checkpoint(path) if isinstance(path, Path) else path).hf_config()


def resolve_dtype(name: str, hf_config: dict) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (float32 if it names none)."""
    if name == "auto":
        name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    if name not in _DTYPES:
        raise ValueError(f"dtype: unsupported value {name!r} (supported: float32, float16, bfloat16)")
    return _DTYPES[name]


def check_tokenizer_files(model: str | Path) -> None:
    """Fail at once, naming the directory, when a local checkpoint directory holds no tokenizer file."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"model directory {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                              "copy the tokenizer files there or pass --tokenizer DIR")


def iter_weights(path: Path | Checkpoint, progress: bool | None = None,
                 allow_pickle: bool = False) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint, as its format reads it; a progress bar on a terminal (``progress=None``).

    Pickle checkpoints (``.bin``, ``.pt``) are refused unless ``allow_pickle``, and then read with
    ``torch.load(weights_only=True)``, which builds tensors and plain containers only, never objects."""
    checkpoint = open_checkpoint(path) if isinstance(path, Path) else path
    yield from checkpoint.iter_weights(progress, allow_pickle)


__all__ = ["CheckpointError", "ModelNotFoundError", "check_tokenizer_files", "iter_weights", "open_checkpoint",
           "read_hf_config", "resolve_dtype", "resolve_model_path"]
