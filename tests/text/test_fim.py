"""text/fim.py: each format's fill-in-the-middle prompt ids against the layout its model family documents,
built by transformers' tokenizer of the same files (the oracle)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pluginfer.text.fim import fim_prompt, fim_tokens
from pluginfer.text.tokenizer import load_tokenizer, transformers_gguf_tokenizer
from tests.formats.test_gguf_tokenizer import sentencepiece_vocabulary, write_gguf

# Each family's markers, then the tokens that end its middle (Qwen2.5-Coder's and StarCoder2's tokenizer files).
FAMILY_TOKENS = {
    "qwen": ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|endoftext|>", "<|file_sep|>",
             "<|repo_name|>"],
    "starcoder": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<|endoftext|>", "<file_sep>"],
}
PREFIX, SUFFIX = "def add(a, b):\n    return", "\n\nprint(add(1, 2))  # 3\n"
CASES = [(PREFIX, SUFFIX), ("x = [", " 1, 2]"), ("", "tail"), ("head ", ""), ("é😀", "ü\n")]


def fim_tokenizer_dir(base: Path, out: Path, family: str) -> Path:
    """The demo tokenizer with one family's fill-in-the-middle tokens added as special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.add_tokens(FAMILY_TOKENS[family], special_tokens=True)
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module", params=sorted(FAMILY_TOKENS))
def family_tokenizers(request, tiny_tokenizer_dir, tmp_path_factory):
    directory = fim_tokenizer_dir(tiny_tokenizer_dir, tmp_path_factory.mktemp(request.param), request.param)
    return request.param, load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize(("prefix", "suffix"), CASES)
def test_prompt_is_the_documented_psm_layout(family_tokenizers, prefix, suffix):
    """``PRE prefix SUF suffix MID``: the string the model cards give, tokenized by transformers, and the same
    ids put together one piece at a time."""
    family, ours, theirs = family_tokenizers
    pre, suf, mid = FAMILY_TOKENS[family][:3]
    fim = fim_tokens(ours)
    assert fim is not None and fim.name == family
    ids = fim_prompt(ours, fim, prefix, suffix)
    assert ids == theirs.encode(pre + prefix + suf + suffix + mid, add_special_tokens=False)
    assert ids == [theirs.convert_tokens_to_ids(pre), *theirs.encode(prefix, add_special_tokens=False),
                   theirs.convert_tokens_to_ids(suf), *theirs.encode(suffix, add_special_tokens=False),
                   theirs.convert_tokens_to_ids(mid)]
    assert set(fim.stop_token_ids) == set(theirs.convert_tokens_to_ids(FAMILY_TOKENS[family][3:]))


def test_markers_are_ids_never_text_that_could_merge(family_tokenizers):
    """A prefix that ends like a marker begins, and a suffix holding a marker's text: the markers are still the
    three ids at their places, the user's text around them encoded as it is."""
    family, ours, theirs = family_tokenizers
    pre, suf, mid = FAMILY_TOKENS[family][:3]
    fim = fim_tokens(ours)
    prefix, suffix = "a <" + pre[1:4], "|" + mid[2:]
    ids = fim_prompt(ours, fim, prefix, suffix)
    prefix_ids, suffix_ids = (theirs.encode(text, add_special_tokens=False) for text in (prefix, suffix))
    assert ids == [fim.prefix, *prefix_ids, fim.suffix, *suffix_ids, fim.middle]


@pytest.fixture(scope="module")
def codellama_gguf(tmp_path_factory) -> Path:
    """A SentencePiece GGUF with CodeLlama's ``▁<PRE>`` ``▁<SUF>`` ``▁<MID>`` ``▁<EOT>`` control tokens and
    the fill-in-the-middle ids in its metadata, as llama.cpp's converter writes them."""
    spm = sentencepiece_vocabulary() + ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"]
    n = len(spm)
    types = [2, 3, 3] + [6] * 256 + [1] * (n - 263) + [3] * 4
    return write_gguf(tmp_path_factory.mktemp("codellama") / "codellama.gguf", spm, "llama", types,
                      scores=[-float(i) for i in range(n)],
                      token_ids={"fim_pre_token_id": n - 4, "fim_suf_token_id": n - 3, "fim_mid_token_id": n - 2,
                                 "eot_token_id": n - 1})


@pytest.mark.parametrize(("prefix", "suffix"), CASES)
def test_codellama_prompt_keeps_its_spaces(codellama_gguf, prefix, suffix):
    """Meta's ``infilling_prompt_tokens``: ``<s> ▁<PRE>`` + the prefix as SentencePiece encodes a text (a leading
    ``▁``) + ``▁<SUF>`` + the suffix without that ``▁`` (``encode_infilling``: encode ``☺`` + text, drop the
    ``☺``'s tokens) + ``▁<MID>``; by transformers' tokenizer of the file."""
    ours, theirs = load_tokenizer(codellama_gguf), transformers_gguf_tokenizer(codellama_gguf)
    fim = fim_tokens(ours)
    assert fim is not None and fim.name == "codellama"
    assert (fim.prefix, fim.suffix, fim.middle) == tuple(theirs.convert_tokens_to_ids(["▁<PRE>", "▁<SUF>", "▁<MID>"]))
    assert fim.stop_token_ids == (theirs.convert_tokens_to_ids("▁<EOT>"),)

    def encode_infilling(text: str) -> list[int]:
        sentinel = theirs.encode("☺", add_special_tokens=False)
        return theirs.encode("☺" + text, add_special_tokens=False)[len(sentinel):] if text else []

    expected = [theirs.bos_token_id, fim.prefix, *(theirs.encode(prefix, add_special_tokens=False) if prefix else []),
                fim.suffix, *encode_infilling(suffix), fim.middle]
    assert fim_prompt(ours, fim, prefix, suffix) == expected


def test_gguf_metadata_names_a_format_outside_the_table(tmp_path):
    """A GGUF file whose fim_pre/fim_suf/fim_mid ids name tokens no row of the table has: those ids."""
    spm = sentencepiece_vocabulary() + ["<pre>", "<suf>", "<mid>"]
    n = len(spm)
    path = write_gguf(tmp_path / "other.gguf", spm, "llama", [2, 3, 3] + [6] * 256 + [1] * (n - 262) + [3] * 3,
                      scores=[-float(i) for i in range(n)],
                      token_ids={"fim_pre_token_id": n - 3, "fim_suf_token_id": n - 2, "fim_mid_token_id": n - 1})
    fim = fim_tokens(load_tokenizer(path))
    assert fim is not None and (fim.name, fim.prefix, fim.suffix, fim.middle) == ("gguf", n - 3, n - 2, n - 1)


def test_a_tokenizer_without_fim_tokens_has_no_format(tiny_tokenizer_dir):
    assert fim_tokens(load_tokenizer(tiny_tokenizer_dir)) is None
