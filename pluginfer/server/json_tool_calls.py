"""Tool calls a model writes as bare JSON, without its parser's marker: ``{"name": ..., "arguments": {...}}``
(or Llama 3's ``"parameters"``) naming a declared tool, or a JSON list of them.

Models such as Qwen2.5-Coder write calls this way under ``tool_choice: auto``, so the server reads them whatever
the parser. Only a value naming a declared tool with no other keys is a call; other JSON, and JSON in a
Markdown fence unless the fence is the whole output, stays content. While the output grows, text that may
still become a call is held back, so the content only ever grows.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pluginfer.core.parsers import FunctionCall
from pluginfer.server.tool_parsers import function_call, outside_fences

_CALL_KEYS = {"name", "arguments", "parameters", "type"}
_FIRST_KEYS = ('"name"', '"arguments"', '"parameters"', '"type"')
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)(")?')
_START = re.compile(r"[{\[]")
_FENCE = "```"
_DECODER = json.JSONDecoder()


def _as_call(value: Any, names: set[str]) -> FunctionCall | None:
    if not isinstance(value, dict) or not set(value) <= _CALL_KEYS or value.get("type", "function") != "function":
        return None
    call = function_call(value)
    return call if call is not None and call.name in names else None


def _as_calls(value: Any, names: set[str]) -> list[FunctionCall]:
    """The calls a JSON value is: one call, or a non-empty list of calls only; [] when it is not."""
    values = value if isinstance(value, list) else [value]
    calls = [_as_call(item, names) for item in values]
    return calls if calls and all(calls) else []  # type: ignore[return-value]


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _may_become_call(text: str, at: int, names: set[str]) -> bool:
    """Whether the JSON value at ``text[at]`` (a ``{`` or ``[``) is or can still grow into a call: its first key,
    and the name as far as it is written. A value this says no to is never a call, however it goes on."""
    position = at
    if text[at] == "[":
        position = _skip_space(text, at + 1)
        if position == len(text):
            return True
        if text[position] != "{":
            return False
        try:  # the list's first item, once complete, decides
            first, _ = _DECODER.raw_decode(text, position)
        except ValueError:
            pass
        else:
            return bool(_as_calls(first, names))
    position = _skip_space(text, position + 1)
    head = text[position:position + len('"parameters"')]
    if any(key.startswith(head) for key in _FIRST_KEYS):
        return True  # nothing, or part of a first key, written yet
    if not head.startswith(_FIRST_KEYS):
        return False
    named = _NAME.match(text, position)
    if named is None:
        # '"name": ' not yet followed by its value, or another first key: decided once complete
        return True
    name, closed = named.groups()
    return name in names if closed else any(declared.startswith(name) for declared in names)


def _fenced_output(text: str, names: set[str], final: bool) -> list[FunctionCall] | None:
    """The calls of an output that is one fenced JSON block of calls and nothing else but whitespace (how
    Qwen2.5-Coder often answers); ``[]`` while the output may still become one; None when it is not one."""
    head = text.lstrip()
    if not final and _FENCE.startswith(head):
        return []
    if not head.startswith(_FENCE):
        return None
    body = head[len(_FENCE):]
    tag = re.match(r"j(?:s(?:on?)?)?", body)
    if tag is not None and not final and tag.end() == len(body):
        return []  # the language tag as far as it came
    body = body[len("json"):] if body.startswith("json") else body
    start = _skip_space(body, 0)
    if start == len(body):
        return None if final else []
    if body[start] not in "{[" or not _may_become_call(body, start, names):
        return None
    try:
        value, after = _DECODER.raw_decode(body, start)
    except ValueError:
        return None if final else []
    calls, rest = _as_calls(value, names), body[after:].strip()
    if not calls:
        return None
    if final:
        return calls if rest == _FENCE else None
    return [] if _FENCE.startswith(rest) else None  # the closing fence as far as it came


def json_tool_calls(text: str, names: set[str], final: bool) -> tuple[str, list[FunctionCall]]:
    """(content, calls) of ``text``: each bare JSON call of a tool in ``names``, outside code fences, taken out of
    the content, or the calls of an output that is one fenced block of them. With ``final`` False, a possible
    call's unfinished text and trailing whitespace are held back."""
    fenced = _fenced_output(text, names, final)
    if fenced is not None:
        return "", fenced
    content: list[str] = []
    calls: list[FunctionCall] = []
    kept = 0  # text[kept:] is not content yet
    held = None  # where an unfinished value that may become a call starts
    for start, end in outside_fences(text):
        position = start
        while held is None and (match := _START.search(text, position, end)) is not None:
            at, position = match.start(), match.start() + 1  # a value that is no call: its inside is looked at too
            if not _may_become_call(text, at, names):
                continue
            try:
                value, after = _DECODER.raw_decode(text, at)
            except ValueError:
                held = None if final else at
                continue
            found = _as_calls(value, names) if after <= end else []
            if found:
                content.append(_between(text[kept:at], bool(calls)))
                calls += found
                kept = position = after
        if held is not None:
            break
    content.append(_between(text[kept:held], bool(calls)))
    joined = "".join(content)
    if not final:
        return joined.rstrip(), calls
    return (joined if joined.strip() else ""), calls


def _between(text: str, after_call: bool) -> str:
    """Text after a call that is only separators (``;`` ``,`` and whitespace: Llama 3 joins calls with ``; ``)
    belongs to the calls, not the content."""
    return "" if after_call and not text.strip(" \t\r\n;,") else text
