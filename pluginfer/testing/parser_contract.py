"""Conformance kit: what every tool-call parser and reasoning parser plugin owes the server.

Called with the spec's factory and a few texts in its format, each with the split it must give once final;
raises AssertionError on the first broken promise of ``pluginfer.core.parsers``: the whole text splits as
expected, a growing output (``final=False``) only grows and adds up to the whole split, no text makes it
raise, tool-call ids are fresh strings and ``needs_special_tokens`` is a bool.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence

from pluginfer.core.parsers import FunctionCall, ReasoningParser, ToolCallParser, ToolCallSyntax

NOISE = ("", " ", "\n", "{", "}", "[", "]", "<", ">", '"', "{}", "[]", "null", "\\", "\x00", "é", "😀", "``", ":")


def _noise(markers: Sequence[str], seed: int, count: int = 200) -> list[str]:
    """Texts made of pieces of the markers and of JSON, to find a parser that raises."""
    rng = random.Random(seed)
    pieces = [*NOISE, *markers, *(m[: len(m) // 2] for m in markers), *(m[len(m) // 2:] for m in markers)]
    return ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12))) for _ in range(count)]


def _calls(calls: list[FunctionCall]) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def check_tool_parser(factory: Callable[[], ToolCallParser],
                      samples: Sequence[tuple[str, str, list[tuple[str, dict]]]],
                      markers: Sequence[str] = (), seed: int = 0) -> None:
    """``samples``: (output text, expected content, expected calls as (name, arguments dict)). ``markers``:
    the format's marker strings, mixed into random texts the parser must survive."""
    parser = factory()
    assert isinstance(parser.needs_special_tokens, bool), "needs_special_tokens must be a bool"
    assert isinstance(parser.call_syntax, tuple) and all(isinstance(s, ToolCallSyntax) for s in parser.call_syntax), \
        "call_syntax must be a tuple of ToolCallSyntax (empty: no grammar under tool_choice auto)"
    ids = [parser.new_id() for _ in range(8)]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids), f"ids must be fresh: {ids}"
    for text, content, calls in samples:
        whole = factory().parse(text, final=True)
        assert (whole.content, _calls(whole.calls)) == (content, calls), \
            f"{text!r} parsed as {whole.content!r} and {whole.calls}, expected {content!r} and {calls}"
        streaming, seen_content, seen_calls = factory(), "", []
        for cut in range(len(text) + 1):
            part = streaming.parse(text[:cut], final=cut == len(text))
            assert part.content.startswith(seen_content), (
                f"content shrank at {text[:cut]!r}: {seen_content!r} then {part.content!r}")
            assert part.calls[: len(seen_calls)] == seen_calls, f"a complete call changed at {text[:cut]!r}"
            seen_content, seen_calls = part.content, list(part.calls)
        assert (seen_content, _calls(seen_calls)) == (content, calls), f"streaming {text!r} ended otherwise"
    for text in _noise(markers, seed):
        for final in (False, True):
            result = factory().parse(text, final)
            assert isinstance(result.content, str) and all(isinstance(c, FunctionCall) for c in result.calls)
            for call in result.calls:
                assert isinstance(json.loads(call.arguments), dict), f"arguments of {call} are no JSON object"


def check_reasoning_parser(factory: Callable[[], ReasoningParser], samples: Sequence[tuple[str, str, str]],
                           markers: Sequence[str] = (), seed: int = 0) -> None:
    """``samples``: (output text, expected reasoning, expected content)."""
    for text, reasoning, content in samples:
        assert factory().split(text, final=True) == (reasoning, content), \
            f"{text!r} split as {factory().split(text, final=True)}, expected {(reasoning, content)}"
        streaming, seen = factory(), ("", "")
        for cut in range(len(text) + 1):
            now = streaming.split(text[:cut], final=cut == len(text))
            assert now[0].startswith(seen[0]) and now[1].startswith(seen[1]), \
                f"the split shrank at {text[:cut]!r}: {seen} then {now}"
            seen = now
        assert seen == (reasoning, content), f"streaming {text!r} ended as {seen}"
    for text in _noise(markers, seed):
        for final in (False, True):
            reasoning, content = factory().split(text, final)
            assert isinstance(reasoning, str) and isinstance(content, str)
