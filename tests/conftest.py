"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained on pluginfer/demo/corpus.txt, saved once per session."""
    from pluginfer.demo.tokenizer import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))
