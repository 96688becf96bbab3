"""What the server asks of a tool-call parser and of a reasoning parser (plugin kinds ``tool_parser`` and
``reasoning_parser``), and the values a tool-call parser returns.

Both read the output text of one choice so far. While it still grows (``final`` False) a parser holds
back a tail that may be the start of one of its markers, so what it returns only ever grows: the
server streams the differences between one call and the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class FunctionCall:
    """One complete tool call: the function's name and its arguments as JSON object text."""

    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)


@dataclass(frozen=True)
class ToolCallSyntax:
    """How a model writes one call, for the grammar that holds calls under ``tool_choice: auto``: ``begin``
    (``{name}`` where the function's name goes), the arguments as one JSON object, then ``end``.

    The model writes free text until ``trigger`` (a prefix of ``begin``, e.g. ``<tool_call>``) appears;
    from there the output is held to a call of one of the request's tools, up to ``end``, and free text
    may follow. With ``opens_output`` a call can only open the output (and is then the whole output), and
    output that does not open with ``trigger`` is free text. Pieces of ``begin`` and ``end`` that are
    added tokens of the model's tokenizer (``<tool_call>``, ``[TOOL_CALLS]``) are matched as those tokens."""

    trigger: str
    begin: str
    end: str
    opens_output: bool = False


@dataclass
class ToolCallText:
    """An output text split into content (the text outside tool calls) and the complete calls."""

    content: str
    calls: list[FunctionCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    """Reads the tool calls a model wrote in its own format (``tool_choice: auto``). The spec's
    ``factory()`` makes one for each request; it may keep state across that request's calls."""

    needs_special_tokens: bool
    """True when a marker is a special token: the server then keeps special tokens in the output text
    (and strips them from the content it returns)."""

    call_syntax: tuple[ToolCallSyntax, ...]
    """The ways this parser's model writes a call, each a call this parser reads back (``()``: none declared,
    the output under ``tool_choice: auto`` is then not held by a grammar); with ``tool_choice: auto`` the
    server holds a call, once its trigger appears, to a declared tool and its schema."""

    def parse(self, text: str, final: bool) -> ToolCallText:
        """The content and the complete calls of ``text``. Text that holds no call, or a call that does
        not parse once ``final``, is content. Never raises on any text."""
        ...

    def new_id(self) -> str:
        """A fresh tool-call id (``call_...``; some chat templates require their own shape)."""
        ...


class ReasoningParser(Protocol):
    """Splits off the reasoning a model writes before its answer (``message.reasoning_content``). The
    spec's ``factory()`` makes one for each choice."""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """``(reasoning, content)`` of ``text``; with ``final`` False, a possible partial tag is held
        back. Never raises on any text."""
        ...
