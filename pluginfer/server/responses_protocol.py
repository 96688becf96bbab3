"""Request bodies of the Responses API (``POST /v1/responses``), and the chat request each one runs as.

A Responses request is a conversation: ``instructions``, the stored conversation of ``previous_response_id``
and ``input``'s items (``responses_input.py``) become chat messages; function tools, ``tool_choice`` and
``text.format`` become chat's ``tools``, ``tool_choice`` and ``response_format``. Fields follow protocol.py's
rules: strict types, and an unknown or unimplemented field is a 400 naming it (``unsupported.RESPONSES``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pluginfer.server.errors import APIError, bad_request, from_validation_error
from pluginfer.server.protocol import ChatCompletionRequest
from pluginfer.server.tools import FunctionDefinition, allowed_tools_choice
from pluginfer.server.unsupported import RESPONSES, CheckedRequest, Unsupported, check_metadata


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionTool(FunctionDefinition):
    """A Responses function tool: chat's function definition, flat, beside its type."""

    type: Literal["function"]

    def chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class ToolChoiceAllowed(_Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[ToolChoiceFunction] = Field(min_length=1)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """Chat's ``response_format`` for this format (its json_schema nested, not flat)."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": self.model_dump(exclude={"type"}, exclude_none=True,
                                                                      by_alias=True)}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Any = None

    @field_validator("verbosity", mode="before")
    @classmethod
    def _no_verbosity(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("verbosity is not supported: no served model reads it; accepted values: null")


class ReasoningConfig(_Strict):
    # passed to chat templates that read it (reasoning_effort), else a 400
    effort: str | None = None
    summary: Any = None
    generate_summary: Any = None

    @field_validator("summary", "generate_summary", mode="before")
    @classmethod
    def _no_summary(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("no reasoning summaries are written (the reasoning item carries the reasoning text); "
                             "accepted values: null")


class StreamOptions(_Strict):
    include_obfuscation: Literal[False] = False  # padding events against length side channels: not sent


class ResponsesRequest(CheckedRequest):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | ToolChoiceAllowed | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # default true: kept for GET and previous_response_id (server.responses_store_size)
    store: bool | None = None
    # Informational: OpenAI's account-side identifiers and tags; they change nothing in the answer.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = None

    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = RESPONSES


    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, items: Any) -> Any:
        if not isinstance(items, str | list) or isinstance(items, list) and not all(isinstance(i, dict) for i in items):
            raise ValueError("must be a string or a list of input items (objects)")
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else []:
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ValueError(f"only function tools are served, got a {tool.get('type')!r} tool")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, choice: Any) -> Any:
        if not isinstance(choice, str | dict):
            raise ValueError(f"must be none, auto, required or {{type: function, name}}, got {choice!r}")
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError(f"must be none, auto, required or {{type: function, name}}, got {choice!r}")
        if isinstance(choice, dict) and choice.get("type") not in ("function", "allowed_tools"):
            raise ValueError(f"only {{type: function, name}} names a tool (or {{type: allowed_tools, mode, tools}} a "
                             f"few), got type {choice.get('type')!r}")
        if isinstance(choice, dict) and choice["type"] == "allowed_tools":
            return allowed_tools_choice(choice, ToolChoiceAllowed, "{type: allowed_tools, mode: auto or required, "
                                                                  "tools: [{type: function, name}, ...]}")
        return choice

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(metadata)

    @property
    def stored(self) -> bool:
        return self.store is not False

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion this request runs as, over ``messages`` (the whole conversation)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        data: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            data["tools"] = [tool.chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, ToolChoiceFunction):
            data["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif isinstance(self.tool_choice, ToolChoiceAllowed):
            data["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {
                "mode": self.tool_choice.mode,
                "tools": [{"type": "function", "function": {"name": t.name}} for t in self.tool_choice.tools]}}
        else:
            data["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            data["response_format"] = self.text.format.response_format()
        if self.reasoning is not None:
            data["reasoning_effort"] = self.reasoning.effort
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in data.items() if v is not None})
        except ValidationError as exc:
            raise from_validation_error(exc) from None


# Chat's request fields, as this API names them; a message's index counts instructions and earlier turns, so
# ``messages.N...`` is the whole input.
_RENAMES = [(re.compile(r"^max_(completion_)?tokens\b"), "max_output_tokens"),
            (re.compile(r"^messages(\.[\w.]+)?\b"), "input"),
            (re.compile(r"^response_format(\.json_schema)?\b"), "text.format"),
            (re.compile(r"^reasoning_effort\b"), "reasoning.effort"),
            (re.compile(r"^tools\.(\d+)\.function\b"), r"tools.\1")]


def _renamed(text: str) -> str:
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return text


@contextmanager
def in_responses_terms() -> Iterator[None]:
    """An APIError of the chat machinery names this API's field (``max_output_tokens``, ``text.format``)."""
    try:
        yield
    except APIError as exc:
        if exc.param is None or _renamed(exc.param) == exc.param:
            raise
        message = _renamed(exc.message) if exc.message.startswith(exc.param) else exc.message
        raise APIError(exc.status, message, _renamed(exc.param), exc.code) from None
