"""Reasoning parsers: the split of whole texts, and streamed deltas that add up to it at any cut."""

from __future__ import annotations

import pytest

from pluginfer.core.registry import UnknownPluginError
from pluginfer.server.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)


@pytest.mark.parametrize(("text", "deepseek", "qwen3"), [
    ("<think>plan</think>answer", ("plan", "answer"), ("plan", "answer")),
    ("plan</think>answer", ("plan", "answer"), ("", "plan</think>answer")),
    ("just an answer", ("just an answer", ""), ("", "just an answer")),
    ("<think>still thinking", ("still thinking", ""), ("still thinking", "")),
    ("", ("", ""), ("", "")),
])
def test_split_of_a_finished_output(text, deepseek, qwen3):
    assert DeepSeekR1ReasoningParser().split(text, final=True) == deepseek
    assert Qwen3ReasoningParser().split(text, final=True) == qwen3


@pytest.mark.parametrize("parser", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
@pytest.mark.parametrize("text", ["<think>a <b> c</thi</think>\nanswer </think> x", "<thin", "x</think",
                                  "<think></think>", "plain <think> text"])
def test_streamed_deltas_add_up_at_every_cut(parser, text):
    expected = parser().split(text, final=True)
    for step in (1, 2, 3, 5):
        stream = ReasoningStream(parser())
        reasoning = content = ""
        for end in range(step, len(text) + step, step):
            r, c = stream.delta(text[:end], final=end >= len(text))
            reasoning, content = reasoning + r, content + c
        assert (reasoning, content) == expected, step


def test_parsers_resolve_through_the_registry_and_an_unknown_one_lists_them():
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(UnknownPluginError, match=r"no reasoning_parser plugin named 'nope'; available: deepseek_r1, (\w+, )*qwen3"):
        get_reasoning_parser("nope")
