"""Tokenizer and chat template, through transformers' AutoTokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        if path.suffix.lower() == ".gguf" and path.is_file():  # built from the file's tokenizer.ggml.* metadata
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {type(exc).__name__}: {exc}") from None


def eos_token_ids(tokenizer: Any, model_path: Path, hf_config: dict) -> set[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json (which may list several)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(tokenizer.eos_token_id)
    add(hf_config.get("eos_token_id"))
    generation = model_path / "generation_config.json"
    if generation.is_file():
        add(json.loads(generation.read_text()).get("eos_token_id"))
    return ids


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, **template_kwargs: Any) -> str:
    """The prompt text for a conversation (and the tools it may call, OpenAI's format), from the
    checkpoint's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat_template; use completions with a plain prompt")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, tools=tools, **template_kwargs)
