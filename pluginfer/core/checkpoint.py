"""What the engine asks of a checkpoint format plugin (kind ``checkpoint_format``).

A format's spec says which paths it reads (``claims(path) -> bool``); its ``factory(path)`` opens
one as a ``Checkpoint``. The built-in formats are safetensors directories and GGUF files
(``pluginfer/formats``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol


class ModelNotFoundError(FileNotFoundError):
    """The model path or hub id leads nowhere; the message says what is missing."""


class CheckpointError(ValueError):
    """A checkpoint file that is truncated, corrupted or unsafe; the message names the file and the problem."""


class Checkpoint(Protocol):
    """One opened checkpoint: its config, its tokenizer and its weights, read when asked."""

    path: Path

    def hf_config(self) -> dict:
        """The Hugging Face ``config.json`` of the model (``architectures`` picks the model plugin)."""
        ...

    def load_tokenizer(self) -> Any:
        """The tokenizer stored with the weights (``encode``, ``decode``, ``apply_chat_template``)."""
        ...

    def iter_weights(self, progress: bool | None = None, allow_pickle: bool = False) -> Iterator[tuple[str, Any]]:
        """Every tensor as ``(name, tensor)``, HF names; a progress bar on a terminal (``progress=None``).
        ``allow_pickle``: a format that can hold pickles reads them only when set (else a ``CheckpointError``)."""
        ...
