"""The check both native tokenizers (formats/gguf/tokenizer.py, text/hf_tokenizer.py) share against transformers'."""

from __future__ import annotations


def assert_same_ids_and_text(ours: object, theirs: object, texts: list[str]) -> None:
    """Each text encodes to the same ids with and without special tokens, and those ids decode to the same
    text with and without skipping special tokens."""
    for text in texts:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == theirs.encode(text, add_special_tokens=add_special_tokens), (text, add_special_tokens)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
