"""check_stop: EOS, stop ids, stop strings, max_tokens and the context, in that order, after min_tokens."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pluginfer.engine.detokenizer import IncrementalDetokenizer
from pluginfer.engine.sequence import FinishReason, SamplingParams, Sequence
from pluginfer.engine.stopping import check_stop

EOS = 2
CONTEXT = 100


def step(seq: Sequence, token: int, detokenizer: IncrementalDetokenizer | None = None) -> FinishReason | None:
    """Append ``token`` as the engine does, then ask check_stop."""
    seq.output_token_ids.append(token)
    if detokenizer is not None:
        detokenizer.append(token)
    return check_stop(seq, token, detokenizer, {EOS}, CONTEXT)


def make(prompt_len: int = 3, **params) -> Sequence:
    return Sequence("r", list(range(10, 10 + prompt_len)), SamplingParams(**params))


def test_eos_stops_and_stays_in_the_token_ids():
    seq = make()
    assert step(seq, 7) is None
    assert step(seq, EOS) is FinishReason.STOP
    assert seq.output_token_ids == [7, EOS]


def test_ignore_eos_keeps_going_until_max_tokens():
    seq = make(ignore_eos=True, max_tokens=3)
    assert [step(seq, EOS) for _ in range(3)] == [None, None, FinishReason.LENGTH]


def test_stop_token_ids_stop_even_with_ignore_eos():
    seq = make(ignore_eos=True, stop_token_ids=[42])
    assert step(seq, 41) is None and step(seq, 42) is FinishReason.STOP


def test_nothing_but_length_stops_before_min_tokens():
    seq = make(min_tokens=3, stop_token_ids=[42], max_tokens=5)
    assert [step(seq, t) for t in (EOS, 42)] == [None, None]
    assert step(seq, EOS) is FinishReason.STOP  # third token: min_tokens reached
    short_context = make(prompt_len=CONTEXT - 1, min_tokens=5)
    assert step(short_context, 7) is FinishReason.LENGTH


def test_stop_beats_length_on_the_same_token():
    seq = make(max_tokens=2)
    assert step(seq, 7) is None and step(seq, EOS) is FinishReason.STOP


@pytest.mark.parametrize(("prompt_len", "max_tokens", "steps"), [(3, 4, 4), (CONTEXT - 2, None, 2), (CONTEXT - 2, 50, 2)])
def test_length_by_max_tokens_or_context(prompt_len, max_tokens, steps):
    seq = make(prompt_len=prompt_len, max_tokens=max_tokens)
    results = [step(seq, 7) for _ in range(steps)]
    assert results == [None] * (steps - 1) + [FinishReason.LENGTH]


def feed(seq: Sequence, detokenizer: IncrementalDetokenizer, tokens: list[int], eos: int) -> FinishReason | None:
    """Feed tokens as the engine does until check_stop answers."""
    for token in tokens:
        seq.output_token_ids.append(token)
        detokenizer.append(token)
        reason = check_stop(seq, token, detokenizer, {eos}, CONTEXT)
        if reason is not None:
            return reason
    return None


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def test_stop_string_through_the_detokenizer(tokenizer):
    seq = Sequence("r", tokenizer.encode("Say:"), SamplingParams(stop=["world"], max_tokens=50))
    detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, seq.params)
    reason = feed(seq, detokenizer, tokenizer.encode(" hello world again"), tokenizer.eos_token_id)
    assert reason is FinishReason.STOP and detokenizer.stopped_by == "world"
    assert tokenizer.decode(seq.output_token_ids).endswith("world")  # stopped on the token completing it
    assert detokenizer.text == " hello "


def test_eos_text_is_not_emitted(tokenizer):
    eos = tokenizer.eos_token_id
    seq = Sequence("r", tokenizer.encode("Say:"), SamplingParams())
    detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, seq.params)
    assert feed(seq, detokenizer, tokenizer.encode(" hi") + [eos, 7], eos) is FinishReason.STOP
    assert seq.output_token_ids[-1] == eos
    assert detokenizer.text + detokenizer.finish() == " hi"
