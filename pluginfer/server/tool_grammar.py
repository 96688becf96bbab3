"""The grammar that holds ``tool_choice: auto`` calls: free text, and once a parser's call trigger appears,
a call of one of the request's tools in the parser's own syntax, its arguments held to the tool's schema.

Written as an llguidance Lark grammar, in the pattern its ``StructTag`` compiles to (as vLLM's structural
tags do on xgrammar): a text trigger is a lazy lexeme (free text ends at its first occurrence); a trigger
that is an added token of the tokenizer (``special_tokens``) is matched as that token, which free text
cannot hold, and free text may not spell it out either. The arguments are ``%json`` with at most one space
between tokens, as models write calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pluginfer.core.parsers import ToolCallSyntax
from pluginfer.engine.regex_ascii import ascii_patterns

NAME = "{name}"
# as models write their calls ({"city": "Oslo"}); none can run on in blanks
CALL_WHITESPACE = "[ ]?"
_TEXT = r"(.|\n)*"


def auto_tool_grammar(syntaxes: tuple[ToolCallSyntax, ...], tools: list[tuple[str, dict[str, Any]]],
                      special_tokens: dict[str, int]) -> str:
    """The Lark grammar for ``tools`` (``(name, arguments schema)``) written in ``syntaxes``.
    ``special_tokens``: the tokenizer's added tokens by text, matched as tokens where a syntax writes them."""
    opening = {syntax.opens_output for syntax in syntaxes}
    if len(opening) != 1:
        raise ValueError("a parser's call syntaxes either all open the output or none does")
    for syntax in syntaxes:
        if not syntax.trigger or not syntax.begin.startswith(syntax.trigger) or NAME in syntax.trigger:
            raise ValueError(f"call syntax {syntax}: begin must start with a non-empty trigger that names no function")
    spelled = [_regex(s.trigger) for s in syntaxes if s.trigger in special_tokens]
    text = f"/{_TEXT}/" + (rf" & ~/(?s:.*)({'|'.join(spelled)})(?s:.*)/" if spelled else "")
    lines = ["%llguidance {}", f"TEXT: {text}"]
    for i, (_, schema) in enumerate(tools):
        held = {**ascii_patterns(schema), "x-guidance": {"whitespace_pattern": CALL_WHITESPACE}}
        lines.append(f"args_{i}: %json {json.dumps(held)}")
    triggers: dict[str, str] = {}
    calls = []
    for syntax in syntaxes:
        special = special_tokens.get(syntax.trigger)
        if syntax.opens_output:
            head = ""  # the trigger is the first piece of begin
        elif special is not None:
            head = f"TEXT <[{special}]> "
        else:
            if syntax.trigger not in triggers:
                triggers[syntax.trigger] = f"trigger_{len(triggers)}"
                lines.append(f"{triggers[syntax.trigger]}[lazy]: TEXT {json.dumps(syntax.trigger)}")
            head = triggers[syntax.trigger] + " "
        rest = syntax.begin if syntax.opens_output else syntax.begin[len(syntax.trigger):]
        for i, (name, _) in enumerate(tools):
            rule = f"call_{len(calls)}"
            begin = _pieces(rest.replace(NAME, name), special_tokens)
            lines.append(f"{rule}: {head}{begin} args_{i} {_pieces(syntax.end, special_tokens)}".rstrip())
            calls.append(rule)
    any_call = " | ".join(calls)
    if syntaxes[0].opens_output:
        text_triggers = [_regex(s.trigger) for s in syntaxes if s.trigger not in special_tokens]
        plain = "TEXT"
        if text_triggers:
            plain += rf" & ~/[ \t\r\n]*({'|'.join(text_triggers)})(?s:.*)/"
        lines.append(f"PLAIN: {plain}")
        lines.append(f"start: PLAIN | {any_call}")
    else:
        lines.append(f"start: ({any_call})* TEXT")
    return "\n".join(lines) + "\n"


def _regex(text: str) -> str:
    return re.escape(text).replace("/", r"\/")


def _pieces(text: str, special_tokens: dict[str, int]) -> str:
    """``text`` as Lark: string literals, and ``<[id]>`` for each added token it holds."""
    out = []
    while text:
        found = [(text.find(token), token) for token in special_tokens if token and token in text]
        if not found:
            out.append(json.dumps(text))
            break
        at, token = min(found, key=lambda hit: (hit[0], -len(hit[1])))
        if at:
            out.append(json.dumps(text[:at]))
        out.append(f"<[{special_tokens[token]}]>")
        text = text[at + len(token):]
    return " ".join(out)


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens by text (``<tool_call>``, ``[TOOL_CALLS]``, ``<|im_end|>``...), which
    llguidance reads as special whether or not they are marked so: a grammar matches them as ``<[id]>``, and
    free text never holds them. Empty for a tokenizer without a Rust backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {}
    return {token.content: token_id for token_id, token in backend.get_added_tokens_decoder().items()}
