"""Find a checkpoint (local directory, hub id or .gguf file) and stream its weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from pluginfer.formats.gguf.checkpoint import (
    GGUFCheckpoint,
    is_gguf_file,
    iter_gguf_weights,
    read_gguf_config,
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    """The model path or hub id leads nowhere; the message says what is missing."""


class CheckpointError(ValueError):
    """A checkpoint file that is truncated, corrupted or unsafe; the message names the file and the problem."""


# Any of these in a model directory makes a tokenizer transformers can load without running code.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tekken.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
    config = _read_json(path / "config.json")
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


def _read_json(file: Path) -> object:
    """A checkpoint's JSON file; a malformed one is a CheckpointError naming it and where it breaks."""
    try:
        return json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); the file is truncated or corrupted") from None


def check_tokenizer_files(model: str | Path) -> None:
    """Fail at once, naming the directory, when a local checkpoint directory holds no tokenizer file."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"model directory {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                              "copy the tokenizer files there or pass --tokenizer DIR")


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} has no weight_map of tensor names to shard files")
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = pickle_files(path)
        if pickles:
            raise CheckpointError(
                f"model directory {path} holds only pickle weights ({', '.join(f.name for f in pickles[:3])}), "
                "which can run code when loaded: convert them to safetensors, or pass --allow-pickle to read "
                "their tensors with torch.load(weights_only=True)")
        raise ModelNotFoundError(f"model directory {path} has no *.safetensors weights")
    return files


def pickle_files(path: Path) -> list[Path]:
    """PyTorch's pickle checkpoints in a directory (``pytorch_model*.bin``, ``*.pt``, ...)."""
    return sorted(f for f in path.iterdir() if f.is_file() and f.suffix in PICKLE_SUFFIXES
                  and not f.name.startswith("training_args"))


def iter_weights(path: Path | GGUFCheckpoint, progress: bool | None = None,
                 allow_pickle: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard, memory-mapped; a progress bar on a terminal (``progress=None``).

    Pickle checkpoints (``.bin``, ``.pt``) are refused unless ``allow_pickle``, and then read with
    ``torch.load(weights_only=True)``, which builds tensors and plain containers only, never objects."""
    if isinstance(path, GGUFCheckpoint):
        yield from path.iter_weights(progress)
        return
    if is_gguf_file(path):
        yield from iter_gguf_weights(path, progress)
        return
    from tqdm import tqdm

    if allow_pickle and not any(path.glob("*.safetensors")) and pickle_files(path):
        yield from _iter_pickle_weights(path)
        return
    files = safetensors_files(path)
    handles = [_safe_open(f) for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=None if progress is None else not progress, leave=False) as bar:
        for file, handle in zip(files, handles):
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f"{file}: cannot read tensor {name!r} ({type(exc).__name__}: {exc}); "
                                          "the file is truncated or corrupted") from None
                yield name, tensor
                bar.update()


def _safe_open(file: Path) -> object:
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file ({exc}); the file is truncated or "
                              "corrupted: download it again") from None


def _iter_pickle_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in pickle_files(path):
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # weights_only refuses any pickle that would build an object
            message = " ".join(str(exc).split())[:300]
            raise CheckpointError(f"{file}: not loaded as weights only ({type(exc).__name__}: {message})") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{file} holds a {type(state).__name__}, not a dict of tensors")
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                yield name, tensor
