"""A Hugging Face checkpoint directory (``config.json``, ``*.safetensors``, tokenizer files) as a checkpoint
format: the built-in ``safetensors`` format plugin. Pickle weights (``.bin``, ``.pt``) in such a directory
are read only with ``allow_pickle``, through ``torch.load(weights_only=True)``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pluginfer.core.checkpoint import CheckpointError, ModelNotFoundError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def claims(path: Path) -> bool:
    """A directory with a ``config.json``."""
    return path.is_dir() and (path / "config.json").is_file()


class SafetensorsCheckpoint:
    """One checkpoint directory; nothing is read until asked."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def hf_config(self) -> dict:
        file = self.path / "config.json"
        config = read_json(file)
        if not isinstance(config, dict):
            raise ValueError(f"{file} does not hold a JSON object")
        if "text_config" in config and "hidden_size" not in config:  # multimodal wrappers (e.g. Gemma 3, Qwen2-VL)
            # the decoder's fields, beside the wrapper's own (vision_config, image_token_id) for a model that reads them
            config = {**config, **config["text_config"], "architectures": config.get("architectures", [])}
        return config

    def load_tokenizer(self) -> Any:
        from pluginfer.text.tokenizer import load_tokenizer

        return load_tokenizer(self.path)

    def iter_weights(self, progress: bool | None = None,
                     allow_pickle: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of every shard, memory-mapped; pickle checkpoints only with ``allow_pickle``."""
        from tqdm import tqdm

        path = self.path
        if allow_pickle and not any(path.glob("*.safetensors")) and pickle_files(path):
            yield from _iter_pickle_weights(path)
            return
        files = safetensors_files(path)
        handles = [_safe_open(f) for f in files]
        total = sum(len(h.keys()) for h in handles)
        disable = None if progress is None else not progress
        with tqdm(total=total, desc="Loading weights", unit="tensor", disable=disable, leave=False) as bar:
            for file, handle in zip(files, handles):
                for name in handle.keys():
                    try:
                        tensor = handle.get_tensor(name)
                    except Exception as exc:
                        raise CheckpointError(f"{file}: cannot read tensor {name!r} ({type(exc).__name__}: {exc}); "
                                              "the file is truncated or corrupted") from None
                    yield name, tensor
                    bar.update()


def read_json(file: Path) -> object:
    """A checkpoint's JSON file; a malformed one is a CheckpointError naming it and where it breaks."""
    try:
        return json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); the file is truncated or corrupted") from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)
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
