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
