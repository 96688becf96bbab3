"""IncrementalDetokenizer against tokenizer.decode of the whole output, with the trained demo tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pluginfer.engine.detokenizer import IncrementalDetokenizer
from pluginfer.engine.sequence import SamplingParams

TEXT = "The rocket 🚀 launched from 东京 at dawn; crème brûlée, 你好世界 and ❤️ followed. 齉龘 🙂!"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def stream(tokenizer, ids: list[int], prompt: str = "Hello", **params) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))
    return [detokenizer.append(token) for token in ids], detokenizer


def split_character(tokenizer) -> str:
    """A character the tokenizer spreads over two or more tokens."""
    for char in TEXT:
        if len(tokenizer.encode(char)) >= 2:
            return char
    raise AssertionError("no character of TEXT is split across tokens")


def test_streamed_deltas_equal_full_decode_and_never_hold_a_partial_character(tokenizer):
    ids = tokenizer.encode(" " + TEXT)
    deltas, detokenizer = stream(tokenizer, ids)
    deltas.append(detokenizer.finish())
    assert "".join(deltas) == tokenizer.decode(ids) == " " + TEXT
    assert detokenizer.text == " " + TEXT
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas[0].startswith(" ")  # the leading space survives


def test_first_token_of_a_split_character_is_held_back(tokenizer):
    char = split_character(tokenizer)
    ids = tokenizer.encode(char)
    deltas, detokenizer = stream(tokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == char == detokenizer.text


def test_output_ending_mid_character_is_flushed_by_finish(tokenizer):
    ids = tokenizer.encode("ok " + split_character(tokenizer))[:-1]
    deltas, detokenizer = stream(tokenizer, ids)
    assert "".join(deltas) + detokenizer.finish() == tokenizer.decode(ids)


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))]


def spanning_stop(tokenizer, text: str) -> tuple[list[int], str]:
    """Ids of ``text`` and a stop string that spans two tokens and ends inside the second."""
    ids = tokenizer.encode(text)
    pieces = token_texts(tokenizer, ids)
    boundary = 0
    for left, right in zip(pieces, pieces[1:], strict=False):
        boundary += len(left)
        if len(left) >= 3 and len(right) >= 3:
            return ids, text[boundary - 2 : boundary + 2]
    raise AssertionError("no two long neighbouring tokens")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_cuts_the_text(tokenizer, include):
    text = "The river rose by almost a meter, and the old stone bridge carried the water."
    ids, stop = spanning_stop(tokenizer, text)
    deltas, detokenizer = stream(tokenizer, ids, stop=["never there", stop], include_stop_str_in_output=include)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detokenizer.stopped_by == stop
    assert "".join(deltas) == detokenizer.text == text[:cut]
    assert detokenizer.append(ids[0]) == "" and detokenizer.finish() == ""
    assert detokenizer.text == text[:cut]


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("one two three four")
    _, detokenizer = stream(tokenizer, ids, stop=["four", "two"])
    assert detokenizer.stopped_by == "two" and detokenizer.text == "one "


def test_partial_stop_is_held_then_released_by_finish(tokenizer):
    ids = tokenizer.encode("Once upon a time, the end")
    deltas, detokenizer = stream(tokenizer, ids, stop=["the end of it"])
    assert "".join(deltas) == "Once upon a time, "  # "the end" may still become the stop string
    assert detokenizer.finish() == "the end"
    assert detokenizer.text == "Once upon a time, the end" and detokenizer.stopped_by is None


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("stop here, then stop again")
    min_tokens = next(n for n in range(len(ids)) if "stop here" in tokenizer.decode(ids[:n]))
    _, detokenizer = stream(tokenizer, ids, stop=["stop"], min_tokens=min_tokens)
    assert detokenizer.stopped_by == "stop" and detokenizer.text == "stop here, then "


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id]
    deltas, detokenizer = stream(tokenizer, ids)
    assert deltas[-1] == "" and detokenizer.text + detokenizer.finish() == "Hi there"
    _, kept = stream(tokenizer, ids, skip_special_tokens=False)
    assert kept.text + kept.finish() == "Hi there</s>"


class _CountingTokenizer:
    """The tokenizer, with the decode calls it gets listed."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, []

    def decode(self, ids, **kwargs):
        self.calls.append(list(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_pushed_tokens_decode_when_text_is_read_to_appends_text(tokenizer):
    char = split_character(tokenizer)
    ids = tokenizer.encode(" " + TEXT + char)[:-1]  # ends mid-character: finish flushes it
    prompt = tokenizer.encode("Hello")
    eager = IncrementalDetokenizer(_CountingTokenizer(tokenizer), prompt, SamplingParams())
    lazy = IncrementalDetokenizer(_CountingTokenizer(tokenizer), prompt, SamplingParams())
    for step, token in enumerate(ids):
        eager.append(token)
        lazy.push(token)
        if step == 7:  # a read part-way (a streamed output) decodes what was pushed so far
            assert lazy.text == eager.text and lazy.tokenizer.calls == eager.tokenizer.calls
    assert len(lazy.tokenizer.calls) < len(eager.tokenizer.calls)  # the rest waits for the next read
    eager.finish(), lazy.finish()
    assert lazy.text == eager.text and lazy.tokenizer.calls == eager.tokenizer.calls  # the same decodes
    assert lazy.text.startswith(" " + TEXT)


def test_pushed_tokens_with_stop_strings_decode_at_once(tokenizer):
    ids = tokenizer.encode(" one two three")
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"), SamplingParams(stop=["two"]))
    for token in ids:
        detokenizer.push(token)
        if detokenizer.stopped_by is not None:
            break
    assert detokenizer.stopped_by == "two" and detokenizer.text == " one "
