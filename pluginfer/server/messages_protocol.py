"""Request bodies of Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), their
translation to what the chat endpoint already serves (the chat template's messages, tools, sampling), and
the shapes of its answers that are not content (errors, usage).

As for the OpenAI routes, a field is honoured or refused: an unknown one, or one asking for what this
server cannot do, is a 400 naming it. Content blocks a client echoes back from a response are lenient
about extra keys. Errors leave in Anthropic's shape (``anthropic_error_body``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pluginfer.engine.strict_schema import strict_json_schema
from pluginfer.engine.structured import StructuredOutputsParams
from pluginfer.server.errors import APIError, bad_request
from pluginfer.server.protocol import SamplingRequest
from pluginfer.server.tools import FunctionDefinition, NamedToolChoice, Tool, ToolChoice
from pluginfer.server.unsupported import CheckedRequest, Unsupported

if TYPE_CHECKING:
    from pluginfer.engine.outputs import RequestOutput

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``; the message names the field at fault."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


class CacheControl(BaseModel):
    """A prompt-caching breakpoint: the prefix cache keeps every prompt's full blocks anyway (LRU, in memory)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # echoed-back blocks carry keys we do not read
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text  # a template has no field for it: the model reads it


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]
_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _BLOCK_TYPES:
                raise ValueError(f"{kind!r} blocks are not served; content blocks may be {', '.join(_BLOCK_TYPES)}")
        return content


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    # server tools (bash, web search, ...) have other types: refused
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    # inputs are held to the schema either way (server.strict_tool_schemas)
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"server tools ({data.get('type')!r}) are not served; give client tools "
                             "(name, description, input_schema)")
        return data

    def as_openai(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition(name=self.name, description=self.description,
                                                                 parameters=self.input_schema))


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is given with type tool, and only then")
        return self

    def as_openai(self) -> ToolChoice:
        if self.type == "tool":
            return NamedToolChoice.model_validate({"type": "function", "function": {"name": self.name}})
        return {"any": "required"}.get(self.type, self.type)  # type: ignore[return-value]


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: JsonOutputFormat | None = None
    effort: None = None

    @field_validator("effort", mode="before")
    @classmethod
    def _no_effort(cls, effort: Any) -> None:
        if effort is not None:
            raise ValueError("reasoning effort is not served")


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    user_id: str | None = None  # informational: identifies the end user; no effect here


_NOT_SERVED = "is not served by this server"
_SHARED: dict[str, Unsupported] = {
    "thinking": Unsupported("thinking budgets and switches are not served; with --reasoning-parser the model's "
                            "reasoning comes back as thinking blocks", (None,)),
    "speed": Unsupported("this server has one speed", (None, "standard")),
    "mcp_servers": Unsupported(f"mcp_servers {_NOT_SERVED}", (None, [])),
    "context_management": Unsupported(f"context_management {_NOT_SERVED}"),
}
MESSAGES: dict[str, Unsupported] = {
    **_SHARED,
    "container": Unsupported(f"container {_NOT_SERVED}"),
    "diagnostics": Unsupported(f"diagnostics {_NOT_SERVED}"),
    "inference_geo": Unsupported(f"inference_geo {_NOT_SERVED}"),
    "service_tier": Unsupported("this server has one service tier", (None, "auto", "standard_only")),
    "user_profile_id": Unsupported(f"user_profile_id {_NOT_SERVED}"),
    "workspace_id": Unsupported(f"workspace_id {_NOT_SERVED}"),
}


class CountTokensRequest(CheckedRequest):
    """``/v1/messages/count_tokens``: the conversation as ``/v1/messages`` renders it."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None

    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = _SHARED


    def openai_tools(self) -> tuple[list[Tool] | None, ToolChoice | None, bool]:
        """(tools, tool_choice, parallel_tool_calls) as the chat endpoint takes them."""
        tools = [tool.as_openai() for tool in self.tools] if self.tools else None
        choice = self.tool_choice
        return tools, choice.as_openai() if choice else None, not (choice and choice.disable_parallel_tool_use)

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates expect it (OpenAI's roles): the system prompt first; a tool_result
        block becomes a ``tool`` message; tool_use blocks become the assistant's ``tool_calls``."""
        if self.messages[-1].role == "assistant":
            raise bad_request("a final assistant message (prefill) is not served: chat templates close the "
                              "assistant's turn", f"messages.{len(self.messages) - 1}.role")
        system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system or [])
        out = [{"role": "system", "content": system}] if self.system is not None else []
        for message in _merged(self.messages):
            out += _for_template(message)
        return out


def _merged(messages: list[Message]) -> list[Message]:
    """Consecutive turns of one role as one turn, as Anthropic combines them (templates may want roles to alternate)."""
    merged: list[Message] = []
    for message in messages:
        if merged and merged[-1].role == message.role:
            blocks = [*_blocks(merged[-1]), *_blocks(message)]
            merged[-1] = Message.model_construct(role=message.role, content=blocks)
        else:
            merged.append(message)
    return merged


def _blocks(message: Message) -> list[Any]:
    if isinstance(message.content, str):
        return [TextBlock(type="text", text=message.content)]
    return message.content


def _for_template(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts = [block.text for block in message.content if isinstance(block, TextBlock)]
    if message.role == "user":
        # tool results answer the previous turn's calls: they come first
        results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                   for block in message.content if isinstance(block, ToolResultBlock)]
        return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])
    calls = [{"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
             for block in message.content if isinstance(block, ToolUseBlock)]  # templates expect the object
    assistant: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}  # thinking is not re-sent
    if calls:
        assistant["tool_calls"] = calls
    return [assistant]


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None

    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = MESSAGES

    def grammar(self) -> tuple[StructuredOutputsParams, str] | None:
        """The grammar ``output_config.format`` asks for (its schema strict, as Anthropic holds it), or None."""
        output_format = self.output_config.format if self.output_config else None
        if output_format is None:
            return None
        return StructuredOutputsParams(json=strict_json_schema(output_format.schema_)), "output_config.format"

    def sampling_request(self) -> SamplingRequest:
        """The sampling fields as the OpenAI routes read them. The stop string is kept in the engine's text so
        the answer can say which one matched (``stop_sequence``); the answer strips it."""
        return SamplingRequest.model_validate({
            "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "stop": self.stop_sequences, "include_stop_str_in_output": bool(self.stop_sequences)})


_OPENAI_FIELDS = ((re.compile(r"\bstop string(s?)\b"), r"stop sequence\1"),
                  (re.compile(r"\bstop\b(?![_ ]sequence)"), "stop_sequences"),
                  (re.compile(r"\b(tools\.\d+)\.function\.parameters\b"), r"\1.input_schema"),
                  (re.compile(r"\btool_choice required\b"), "tool_choice any"),
                  (re.compile(r"\btool_choice named\b"), "tool_choice tool"))


def renamed(error: APIError) -> APIError:
    """An error of the code shared with the OpenAI routes, in this API's words: ``stop`` is ``stop_sequences``,
    a tool's ``function.parameters`` its ``input_schema``, tool_choice ``required`` is ``any``."""
    if not error.param or not (error.param in ("stop", "tool_choice") or error.param.startswith("tools.")):
        return error
    message, param = error.message, error.param
    for pattern, name in _OPENAI_FIELDS:
        message, param = pattern.sub(name, message), pattern.sub(name, param)
    return APIError(error.status, message, param, error.code)


def usage(output: RequestOutput, output_tokens: int) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the (prefix) cache."""
    cached = output.num_cached_tokens
    return {"input_tokens": len(output.prompt_token_ids) - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached}
