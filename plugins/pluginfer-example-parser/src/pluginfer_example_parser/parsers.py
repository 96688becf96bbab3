"""The memo format's parsers. Both read the whole output so far and hold back a tail that may be the start
of a marker while it still grows, so what they return only grows (the server streams the differences)."""

from __future__ import annotations

import json
import secrets

from pluginfer.core.parsers import FunctionCall, ToolCallSyntax, ToolCallText

CALL, END = "<<call ", ">>"
THINK = "~~"


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class MemoToolParser:
    """``<<call NAME {json}>>``: the text before the first call is content, each complete block a call."""

    needs_special_tokens = False  # the markers are plain text
    call_syntax = (ToolCallSyntax(CALL, CALL + "{name} ", END),)  # what parse() reads back, for tool_choice: auto

    def parse(self, text: str, final: bool) -> ToolCallText:
        start = text.find(CALL)
        if start == -1:
            return ToolCallText(text if final else text[: len(text) - _held_back(text, CALL)])
        calls = []
        for block in text[start:].split(CALL)[1:]:
            body, closed, _ = block.partition(END)
            name, _, arguments = body.partition(" ")
            call = self._call(name, arguments) if closed else None
            if call is not None:
                calls.append(call)
        if final and not calls:
            return ToolCallText(text)  # nothing parsed: it was text after all
        return ToolCallText(text[:start], calls)

    @staticmethod
    def _call(name: str, arguments: str) -> FunctionCall | None:
        try:
            value = json.loads(arguments)
        except ValueError:
            return None
        if not name.isidentifier() or not isinstance(value, dict):
            return None
        return FunctionCall(name, json.dumps(value, ensure_ascii=False))

    def new_id(self) -> str:
        return f"call_memo_{secrets.token_hex(8)}"


class MemoReasoningParser:
    """``reasoning ~~ content``: the output is reasoning until ``~~`` (the chat template opens it with ``~~``;
    a model that writes the opening one itself has it skipped)."""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if text.startswith(THINK):
            text = text[len(THINK):]
        elif THINK.startswith(text) and not final:
            return "", ""  # may still become the opening marker
        end = text.find(THINK)
        if end != -1:
            return text[:end].strip(), text[end + len(THINK):].lstrip()
        if final:
            return text.strip(), ""
        return text[: len(text) - _held_back(text, THINK)].strip(), ""  # trailing space may precede the marker
