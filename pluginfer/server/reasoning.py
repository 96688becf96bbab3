"""Reasoning parsers: text inside ``<think>…</think>`` goes to ``reasoning_content``.

A parser splits the whole output text so far into (reasoning, content). While the output is
still growing it holds back a tail that may be the start of a tag, so the split only ever
grows: streamed deltas are the difference from the previous split. Chosen with ``--reasoning-parser``
(``server.reasoning_parser``): these are the built-in plugin's parsers (``pluginfer/server/plugin.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from pluginfer.core.parsers import ReasoningParser
from pluginfer.core.registry import Registry, get_registry

_START, _END = "<think>", "</think>"


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class DeepSeekR1ReasoningParser:
    """DeepSeek-R1 style: the output is reasoning until ``</think>`` (the template may open ``<think>``)."""

    # True: without a leading <think>, the whole output is content
    needs_start_tag = False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``; with ``final`` False, a possible partial tag is held back."""
        if text.startswith(_START):
            text = text[len(_START):]
        elif _START.startswith(text) and not final:
            return "", ""  # may still become <think>
        elif self.needs_start_tag:
            return "", text
        end = text.find(_END)
        if end != -1:
            return text[:end], text[end + len(_END):]
        if final:
            return text, ""
        return text[: len(text) - _partial_tag_len(text, _END)], ""


class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    """Qwen3 style: reasoning only when the output opens with ``<think>`` (thinking can be off)."""

    needs_start_tag = True


class ReasoningStream:
    """Turns a growing output text into (reasoning, content) deltas."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning = ""
        self.content = ""

    def delta(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = self.parser.split(text, final)
        reasoning_delta, content_delta = reasoning[len(self.reasoning):], content[len(self.content):]
        self.reasoning, self.content = reasoning, content
        return reasoning_delta, content_delta


def get_reasoning_parser(name: str, registry: Registry | None = None) -> Callable[[], ReasoningParser]:
    """The factory of the reasoning_parser plugin ``name`` (one parser per choice); an unknown name lists
    the available ones."""
    return (registry or get_registry()).load("reasoning_parser", name)
