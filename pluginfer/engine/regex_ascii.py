r"""ASCII ``\d``, ``\w`` and ``\s`` in regexes and JSON-schema ``pattern``\ s, as ECMAScript, OpenAI and xgrammar read them.

llguidance parses regexes with Rust's regex-syntax, where these classes are Unicode (``\d`` matches ``٣``).
:func:`ascii_regex` rewrites them, and their negations, to explicit ASCII classes before the grammar is built;
escapes (``\\d`` is a backslash and a ``d``) and character classes (``[\d_]``, ``[^\W]``) are followed.
"""

from __future__ import annotations

import copy
from typing import Any

_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": r" \t\n\r\x0C\x0B"}


def ascii_regex(regex: str) -> str:
    r"""``regex`` with ``\d \w \s \D \W \S`` as ASCII classes; nothing else changes."""
    out: list[str] = []
    # nesting of character classes (Rust's syntax nests them: [a[^0-9]])
    depth = 0
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            letter = regex[i + 1]
            members = _CLASSES.get(letter.lower())
            if members is None:
                out.append(regex[i:i + 2])
            elif letter.islower():
                out.append(members if depth else f"[{members}]")
            else:
                out.append(f"[^{members}]")  # nested inside a class: the union with its other members
            i += 2
            continue
        if char == "[":
            if depth and regex.startswith("[:", i):  # a POSIX class such as [:alpha:], ASCII already
                end = regex.find(":]", i + 2)
                if end != -1:
                    out.append(regex[i:end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(char)
            i += 1
            if regex.startswith("^", i):
                out.append("^")
                i += 1
            if regex.startswith("]", i):  # a ] right after the opening is a member, not the end
                out.append("]")
                i += 1
            continue
        if char == "]" and depth:
            depth -= 1
        out.append(char)
        i += 1
    return "".join(out)


def ascii_patterns(schema: Any) -> Any:
    """A copy of a JSON schema whose ``pattern`` and ``patternProperties`` keys go through :func:`ascii_regex`."""
    schema = copy.deepcopy(schema)
    _rewrite(schema)
    return schema


def _rewrite(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _rewrite(item)
        return
    if not isinstance(node, dict):
        return
    for key, value in list(node.items()):
        if key in ("const", "enum", "default", "examples"):
            # data, not schemas: a property value named "pattern" is not a regex
            continue
        if key == "pattern" and isinstance(value, str):
            node[key] = ascii_regex(value)
        elif key == "patternProperties" and isinstance(value, dict):
            node[key] = {ascii_regex(name): sub for name, sub in value.items()}
            for sub in node[key].values():
                _rewrite(sub)
        elif key == "properties" and isinstance(value, dict):
            for sub in value.values():  # a property named "pattern" is a schema, not a regex
                _rewrite(sub)
        else:
            _rewrite(value)
