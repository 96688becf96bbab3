"""Tool-call parsers: the tool calls a model wrote in its own format, as plain functions of text.

A parser splits the output so far into content and complete calls; while it grows (``final`` False) it holds
back a tail that may start its marker, so the content only grows. A block that does not parse stays content,
as vLLM does, and so does a marker inside a Markdown fence. Chosen with ``--tool-call-parser``: the built-in
plugin's parsers, looked up by name like a third party's; bare JSON calls are ``json_tool_calls.py``'s.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from pluginfer.core.parsers import FunctionCall, ToolCallParser, ToolCallSyntax, ToolCallText
from pluginfer.core.registry import Registry, get_registry


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _arguments(value: Any) -> str | None:
    """Arguments as JSON text: a dict, or a string holding a JSON object; None for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def function_call(obj: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> FunctionCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> FunctionCall; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = _arguments(obj[key]) if key else "{}"
    return FunctionCall(obj["name"], arguments) if arguments is not None else None


_FENCE = "```"


def outside_fences(text: str) -> list[tuple[int, int]]:
    """The spans of ``text`` outside Markdown code fences (a fence opens and closes at each `````); an
    unclosed fence runs to the end. A model shows code there, not calls."""
    spans, start = [], 0
    while True:
        opened = text.find(_FENCE, start)
        if opened == -1:
            return [*spans, (start, len(text))]
        spans.append((start, opened))
        closed = text.find(_FENCE, opened + len(_FENCE))
        if closed == -1:
            return spans
        start = closed + len(_FENCE)


def find_outside_fences(text: str, marker: str) -> int:
    """The first index of ``marker`` outside code fences, or -1."""
    for start, end in outside_fences(text):
        found = text.find(marker, start, end)
        if found != -1 and found + len(marker) <= end:
            return found
    return -1


def _json_values(text: str, separators: str = " \t\r\n") -> tuple[list[Any], str]:
    """The JSON values at the start of ``text`` one after another (between ``separators``), and the rest."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position] in separators:
            position += 1
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return values, text[position:]
        values.append(value)


class MarkedToolParser:
    """Tool calls after a marker; the text before it is content. Subclasses parse what follows."""

    marker = ""
    needs_special_tokens = False  # the marker is a special token, so the text must keep them
    call_syntax: tuple[ToolCallSyntax, ...] = ()  # how the model writes a call, for the grammar under auto

    def parse(self, text: str, final: bool) -> ToolCallText:
        start = find_outside_fences(text, self.marker)
        if start == -1:
            if final:
                return ToolCallText(text)
            return ToolCallText(text[: len(text) - _partial_marker_len(text, self.marker)])
        calls = self.calls(text[start:], final)
        if final and not calls:
            return ToolCallText(text)  # nothing parsed: it was text after all
        return ToolCallText(text[:start], calls)

    def calls(self, text: str, final: bool) -> list[FunctionCall]:
        raise NotImplementedError

    def new_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"


class HermesToolParser(MarkedToolParser):
    """Hermes 2 Pro, Qwen2.5, Qwen3, QwQ: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    marker = "<tool_call>"
    call_syntax = (ToolCallSyntax(marker, '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>"),)
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def calls(self, text: str, final: bool) -> list[FunctionCall]:
        bodies = self._block.findall(text)
        tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if bodies else text
        if final and tail.strip().startswith("<tool_call>"):  # the last block's closing tag never came
            bodies.append(tail.strip()[len("<tool_call>"):])
        calls = []
        for body in bodies:
            values, _ = _json_values(body.strip())
            call = function_call(values[0]) if values else None
            if call is not None:
                calls.append(call)
        return calls


class Llama3JsonToolParser(MarkedToolParser):
    """Llama 3.1-3.3 JSON tool calling: the output is ``{"name": ..., "parameters": {...}}`` (several
    joined by ``;``), optionally after ``<|python_tag|>``; output that starts otherwise is content."""

    marker = "<|python_tag|>"
    call_syntax = (ToolCallSyntax("{", '{"name": "{name}", "parameters": ', "}", opens_output=True),
                   ToolCallSyntax(marker, '<|python_tag|>{"name": "{name}", "parameters": ', "}", opens_output=True))

    def parse(self, text: str, final: bool) -> ToolCallText:
        body = text.lstrip()
        if body.startswith(self.marker):
            body = body[len(self.marker):].lstrip()
        elif not body.startswith("{"):
            partial = not body or self.marker.startswith(body)
            if partial and not final:
                return ToolCallText("")
            return ToolCallText(text)
        values, rest = _json_values(body, " \t\r\n;")
        calls = [function_call(value) for value in values]
        if all(calls) and calls and (not rest.strip() or not final):
            return ToolCallText("", calls)  # type: ignore[arg-type]
        return ToolCallText(text if final else "")


class MistralToolParser(MarkedToolParser):
    """Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (tokenizer v3, e.g. 7B v0.3,
    Nemo) or ``[TOOL_CALLS]name[ARGS]{...}`` per call (tokenizer v11+, e.g. Small 3.2, Devstral).
    ``[TOOL_CALLS]`` is a control token: requests keep special tokens in the text. Ids are 9
    alphanumerics, which Mistral's chat templates require of the ids sent back."""

    marker = "[TOOL_CALLS]"
    needs_special_tokens = True
    _args = "[ARGS]"
    call_syntax = (ToolCallSyntax(marker, '[TOOL_CALLS] [{"name": "{name}", "arguments": ', "}]"),
                   ToolCallSyntax(marker, "[TOOL_CALLS]{name}[ARGS]", ""))

    def calls(self, text: str, final: bool) -> list[FunctionCall]:
        pieces = [piece.strip() for piece in text.split(self.marker)[1:]]
        calls: list[FunctionCall] = []
        for piece in pieces:
            if piece.startswith("["):  # v3: a JSON array of calls
                values, _ = _json_values(piece)
                if values and isinstance(values[0], list):
                    calls += [c for c in map(function_call, values[0]) if c is not None]
            elif self._args in piece:  # v11: name[ARGS]{arguments}
                name, _, arguments = piece.partition(self._args)
                values, _ = _json_values(arguments.strip())  # complete once its object closes
                text_arguments = _arguments(values[0]) if values else None
                if text_arguments is not None:
                    calls.append(FunctionCall(name.strip(), text_arguments))
        return calls

    def new_id(self) -> str:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))


class DeepSeekV3ToolParser(MarkedToolParser):
    """DeepSeek V3 / R1-0528: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
    inside ``<｜tool▁calls▁begin｜>…<｜tool▁calls▁end｜>``; V3.1's ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}``
    too."""

    marker = "<｜tool▁calls▁begin｜>"
    call_syntax = (ToolCallSyntax(marker, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
                                  "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
                   ToolCallSyntax(marker, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>",
                                  "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"))
    _call_re = re.compile(r"<｜tool▁call▁begin｜>(?:(?P<type>\w+)<｜tool▁sep｜>(?P<name>[^\n<]+)\n```(?:json)?\n"
                          r"(?P<fenced>.*?)\n```|(?P<name31>[^<]+?)<｜tool▁sep｜>(?P<plain>.*?))<｜tool▁call▁end｜>",
                          re.DOTALL)

    def calls(self, text: str, final: bool) -> list[FunctionCall]:
        calls = []
        for match in self._call_re.finditer(text):
            name = (match.group("name") or match.group("name31")).strip()
            arguments = _arguments((match.group("fenced") or match.group("plain") or "").strip())
            if arguments is not None:
                calls.append(FunctionCall(name, arguments))
        return calls


def get_tool_parser(name: str, registry: Registry | None = None) -> ToolCallParser:
    """A new parser of the tool_parser plugin ``name``; an unknown name lists the available ones."""
    return (registry or get_registry()).load("tool_parser", name)()
