"""EventTemplate: a chunk's event filled in per token is byte for byte the event of the whole chunk."""

from __future__ import annotations

import json

import pytest

from pluginfer.server.streaming import HOLE, EventTemplate, json_string, json_value

TEXTS = ["", "hello", " world", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x1f control",
         "héllo wörld", "漢字", "emoji 😀 astral", "\ud800 lone surrogate", "\u2028\u2029", "</script>"]


def whole_event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def completion_chunk(index: object, text: object, reason: object, model: str = "m") -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_filled_event_equals_the_whole_chunk_event(text: str, reason: str | None) -> None:
    template = EventTemplate(completion_chunk(HOLE, HOLE, HOLE))
    assert template.fill("3", json_string(text), json_value(reason)) == whole_event(completion_chunk(3, text, reason))


def test_nested_holes_and_a_model_name_that_needs_escaping() -> None:
    model = 'my "model" ü'
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model,
             "choices": [{"index": HOLE, "delta": {"content": HOLE}, "logprobs": None, "finish_reason": HOLE}]}
    filled = EventTemplate(chunk).fill(json_value(0), json_string("ü\n"), json_value("tool_calls"))
    expected = dict(chunk, choices=[{"index": 0, "delta": {"content": "ü\n"}, "logprobs": None,
                                     "finish_reason": "tool_calls"}])
    assert filled == whole_event(expected)
    assert json.loads(filled[len(b"data: "):]) == expected


def test_json_value() -> None:
    assert [json_value(v) for v in (None, 7, "a\"b")] == ["null", "7", '"a\\"b"']


def test_the_number_of_values_must_match_the_holes() -> None:
    template = EventTemplate(completion_chunk(HOLE, HOLE, None))
    with pytest.raises(ValueError, match="2 holes, got 3"):
        template.fill("0", '"a"', "null")
    with pytest.raises(ValueError, match="2 holes, got 1"):
        template.fill("0")


def test_a_value_that_is_not_json_is_refused() -> None:
    with pytest.raises(TypeError, match="object is not JSON serializable"):
        EventTemplate(completion_chunk(HOLE, object(), None))
