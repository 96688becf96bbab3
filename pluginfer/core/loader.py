"""Find a checkpoint (local directory, hub id or .gguf file) and stream its weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from pluginfer.core.gguf_checkpoint import GGUFCheckpoint, is_gguf_file, iter_gguf_weights, read_gguf_config

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    """The model path or hub id leads nowhere; the message says what is missing."""


def _looks_like_path(model: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else is meant as a local path."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local checkpoint directory for ``model``: the directory itself, or a hub snapshot."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json (not a Hugging Face checkpoint)")
        return path
    if is_gguf_file(path):
        return path
    if path.exists():
        raise ModelNotFoundError(f"model path {path} is a file, not a checkpoint directory (nor a .gguf file)")
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


def open_checkpoint(path: Path) -> Path | GGUFCheckpoint:
    """What ``read_hf_config`` and ``iter_weights`` read: a ``.gguf`` file opened once (its metadata, which
    holds the whole vocabulary, is parsed once for both: seconds for a large vocabulary), else the path."""
    return GGUFCheckpoint(path) if is_gguf_file(path) else path


def read_hf_config(path: Path | GGUFCheckpoint) -> dict:
    if isinstance(path, GGUFCheckpoint):
        return path.hf_config()
    if is_gguf_file(path):
        return read_gguf_config(path)
    with open(path / "config.json") as config_file:
        config = json.load(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'} does not hold a JSON object")
    if "text_config" in config and "hidden_size" not in config:  # multimodal wrappers (e.g. Gemma 3)
        config = {**config["text_config"], "architectures": config.get("architectures", [])}
    return config


def resolve_dtype(name: str, hf_config: dict) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (float32 if it names none)."""
    if name == "auto":
        name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    if name not in _DTYPES:
        raise ValueError(f"dtype: unsupported value {name!r} (supported: float32, float16, bfloat16)")
    return _DTYPES[name]


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model directory {path} has no *.safetensors weights")
    return files


def iter_weights(path: Path | GGUFCheckpoint, progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard, memory-mapped; a progress bar on a terminal (``progress=None``)."""
    if isinstance(path, GGUFCheckpoint):
        yield from path.iter_weights(progress)
        return
    if is_gguf_file(path):
        yield from iter_gguf_weights(path, progress)
        return
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(path)
    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=None if progress is None else not progress, leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update()
