"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained on pluginfer/demo/corpus.txt, saved once per session."""
    from pluginfer.demo.tokenizer import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


# A llama small enough to build in well under a second: hidden 64, 2 layers, GQA (4 heads, 2 KV heads).
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory,
                          tiny_tokenizer_dir: Path) -> tuple[Path, object]:
    """(directory, transformers model) of a float32 single-file tiny llama; copy it before editing."""
    from tests.checkpoints import save_hf_model

    out = tmp_path_factory.mktemp("tiny_llama")
    model = save_hf_model("LlamaForCausalLM", TINY_LLAMA, out, tiny_tokenizer_dir)
    return out, model


@pytest.fixture
def unknown_architecture_checkpoint(tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> Path:
    """The tiny llama with config.json claiming an architecture no plugin serves (FooForCausalLM, foo)."""
    import json
    import shutil

    path = tmp_path / "foo"
    shutil.copytree(tiny_llama_checkpoint[0], path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["FooForCausalLM"], model_type="foo")
    (path / "config.json").write_text(json.dumps(config))
    return path
