"""Fill-in-the-middle: the prompt a coder model completes between a prefix and a suffix.

Each format is a row of ``FORMATS``: the three marker tokens of its tokenizer and the tokens that end the
middle. A tokenizer's format is the first row whose markers are all in its vocabulary, or, for a GGUF file,
the ids its ``tokenizer.ggml.fim_pre_token_id`` / ``fim_suf`` / ``fim_mid`` metadata names
(``GGUFTokenizer.fim_token_ids``). The prompt is built from ids, never by tokenizing a string with the
markers in it (text around a marker could merge with it): prefix-suffix-middle order,
``[bos] PRE prefix SUF suffix MID``, as Qwen2.5-Coder, StarCoder2, CodeLlama and llama.cpp's ``/infill`` lay it out.
A tokenizer plugin with another format adds a row, or sets ``fim_token_ids`` on its tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FimFormat:
    """One model family's fill-in-the-middle tokens. ``stops``: tokens that end the middle where the vocabulary
    has them; ``suffix_without_space``: the suffix is encoded without the space SentencePiece puts before a text
    (CodeLlama's ``encode_infilling``), so the middle is asked for right where the suffix starts."""

    name: str
    prefix: str
    suffix: str
    middle: str
    stops: tuple[str, ...] = ()
    suffix_without_space: bool = False


FORMATS: tuple[FimFormat, ...] = (
    FimFormat("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
              ("<|fim_pad|>", "<|endoftext|>", "<|file_sep|>", "<|repo_name|>")),
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>",
              ("<fim_pad>", "<|endoftext|>", "<file_sep>")),
    FimFormat("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", ("▁<EOT>",), suffix_without_space=True),
)


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's fill-in-the-middle ids: the three markers, and the ids that end the middle."""

    name: str
    prefix: int
    suffix: int
    middle: int
    stop_token_ids: tuple[int, ...]
    suffix_without_space: bool = False


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The tokenizer's fill-in-the-middle ids, or None when it has no fill-in-the-middle tokens."""
    given = getattr(tokenizer, "fim_token_ids", None)  # a GGUF file's metadata, or a tokenizer plugin's
    vocab = tokenizer.get_vocab()
    if given and all(given.get(key) is not None for key in ("prefix", "suffix", "middle")):
        known = next((f for f in FORMATS if vocab.get(f.prefix) == given["prefix"]), None)
        stops = [*given.get("stops", ()), *_ids(vocab, known.stops if known else ())]
        return FimTokens(known.name if known else "gguf", given["prefix"], given["suffix"], given["middle"],
                         tuple(dict.fromkeys(stops)), known is not None and known.suffix_without_space)
    for fim in FORMATS:
        if all(token in vocab for token in (fim.prefix, fim.suffix, fim.middle)):
            return FimTokens(fim.name, vocab[fim.prefix], vocab[fim.suffix], vocab[fim.middle],
                             tuple(_ids(vocab, fim.stops)), fim.suffix_without_space)
    return None


def _ids(vocab: dict[str, int], tokens: tuple[str, ...]) -> list[int]:
    return [vocab[token] for token in tokens if token in vocab]


def fim_prompt(tokenizer: Any, fim: FimTokens, prefix: str, suffix: str) -> list[int]:
    """The prompt ids that ask for the text between ``prefix`` and ``suffix``: BOS where the tokenizer adds one,
    then ``PRE prefix SUF suffix MID``."""
    opening = tokenizer.encode("", add_special_tokens=True)[:1]
    bos = opening if opening and opening[0] == tokenizer.bos_token_id else []
    suffix_ids = _without_space(tokenizer, suffix) if fim.suffix_without_space else _plain(tokenizer, suffix)
    return [*bos, fim.prefix, *_plain(tokenizer, prefix), fim.suffix, *suffix_ids, fim.middle]


def _plain(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def _without_space(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids without the space SentencePiece adds before a text: encoded after a newline, whose own
    ids (the space and the newline byte) are then dropped, as Meta's ``encode_infilling`` drops its ``☺``."""
    if not text:
        return []
    lead = _plain(tokenizer, "\n")
    ids = _plain(tokenizer, "\n" + text)
    return ids[len(lead):] if ids[:len(lead)] == lead else _plain(tokenizer, text)
