"""Request bodies of the OpenAI API (and vLLM's extensions), as pydantic models.

A request field is honoured or refused: an unknown field, or one asking for what this server
cannot do, is a 400 naming it (``unsupported.py``). Nested objects a client echoes back
(messages) are lenient about extra keys. Types are strict (pydantic's strict mode): no string
for a boolean, no 5.0 for an integer, no boolean for a number; an integer is a float. ``sampling_params`` turns a request into the engine's SamplingParams.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pluginfer.core.config import BUILTIN_SAMPLING, SamplingDefaults
from pluginfer.engine.sequence import SamplingParams
from pluginfer.engine.structured import StructuredOutputsParams
from pluginfer.server.errors import APIError, bad_request, from_sampling_error
from pluginfer.server.grammar import ResponseFormat, StructuredOutputsRequest, requested_grammar
from pluginfer.server.tools import Tool, ToolChoice, allowed_tools_choice
from pluginfer.server.unsupported import CHAT, COMPLETION, CheckedRequest, Unsupported, check_metadata

Prompt = str | list[int]
_INT64_MAX = 2**63 - 1


class _Body(BaseModel):
    # Strict types, as OpenAI checks them: "stream": "yes" or "max_tokens": 5.0 is a 400 (an int is still a float).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: Literal[False] = False  # padding events against length side channels: not sent


class ContentPart(_Body):
    type: str
    text: str | None = None
    # {"url": "data:image/png;base64,..."}: decoded by the chat route
    image_url: dict[str, Any] | str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        if isinstance(content, list):
            for part in content:
                if part.type == "image_url" and part.image_url is not None:
                    continue
                if part.type != "text" or part.text is None:
                    raise ValueError(f"only text and image_url content parts are served, got a {part.type!r} part")
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content a string, text parts joined by newlines; a message
        with image parts keeps its parts (the chat route turns them into images and ``{"type": "image"}``)."""
        content = self.content
        if isinstance(content, list) and any(part.type == "image_url" for part in content):
            content = [part.model_dump(exclude_none=True) for part in content]  # images: the parts, in order
        elif isinstance(content, list):
            content = "\n".join(part.text or "" for part in content)
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name; templates know "system"
        message: dict[str, Any] = {"role": role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls is not None:
            message["tool_calls"] = [_call_for_template(call) for call in self.tool_calls]
        return message


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends a call's arguments as JSON text; chat templates (Qwen, Llama, Mistral) expect the object."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        if isinstance(arguments, dict):
            return {**call, "function": {**function, "arguments": arguments}}
    return call


def _normalize_stop(value: Any) -> Any:
    """Accept ``"s"``, ``["a", "b"]`` and the tagged forms ``{"Single": s}`` / ``{"Multiple": [...]}``."""
    if isinstance(value, dict) and len(value) == 1:
        tag, inner = next(iter(value.items()))
        if tag == "Single" and isinstance(inner, str):
            return [inner]
        if tag == "Multiple" and isinstance(inner, list):
            return inner
    if isinstance(value, str):
        return [value]
    return value


class SamplingRequest(CheckedRequest):
    """The fields chat and completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=_INT64_MAX)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    n: int = Field(1, ge=1)  # at most server.max_n (server/limits.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    # informational: identifies the end user to OpenAI; no effect here
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    use_beam_search: bool = False  # vLLM's: the n best beams are the choices (server/beam.py)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    LOGPROBS_FIELD: ClassVar[str] = "logprobs"  # the request field a SamplingParams.logprobs error names


    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, stop: Any) -> Any:
        return _normalize_stop(stop)

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.lstrip("-").isdigit() or int(token) < 0:
                raise ValueError(f"keys must be token ids, got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"values must be in [-100, 100], got {value}")
        return bias

    def _max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def _logprobs(self, max_logprobs: int) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return None

    def grammar(self) -> tuple[StructuredOutputsParams, str] | None:
        """The grammar the output must follow and the request field that asked for it, or None."""
        return requested_grammar(self.response_format, self.structured_outputs)

    def sampling_params(self, defaults: SamplingDefaults, max_logprobs: int) -> SamplingParams:
        """The engine's parameters; an invalid value is a 400 naming the request field."""
        max_tokens, max_tokens_field = self._max_tokens()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")

        def pick(value: Any, default: Any, name: str = "") -> Any:
            if value is None:
                # the request's, else the defaults' (the model's already laid in), else built in
                value = default
            return BUILTIN_SAMPLING[name] if value is None else value

        grammar = self.grammar()

        try:
            return SamplingParams(
                n=self.n, temperature=pick(self.temperature, defaults.temperature, "temperature"),
                top_p=pick(self.top_p, defaults.top_p, "top_p"), top_k=pick(self.top_k, defaults.top_k, "top_k"),
                min_p=pick(self.min_p, defaults.min_p, "min_p"),
                repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty, "repetition_penalty"),
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0), seed=self.seed, stop=self.stop,
                stop_token_ids=self.stop_token_ids, max_tokens=pick(max_tokens, defaults.max_tokens),
                min_tokens=pick(self.min_tokens, 0), ignore_eos=self.ignore_eos,
                logprobs=self._logprobs(max_logprobs), prompt_logprobs=self._prompt_logprobs(),
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias={int(t): v for t, v in self.logit_bias.items()} if self.logit_bias else None,
                structured_outputs=grammar[0] if grammar else None,
            )
        except ValueError as exc:
            raise from_sampling_error(exc, {"max_tokens": max_tokens_field, "logprobs": self.LOGPROBS_FIELD}
                                      ) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    reasoning_effort: str | None = None  # passed to chat templates that read it; else a 400
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Informational: OpenAI's account-side identifiers and tags; they change nothing in the answer.
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None

    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = CHAT

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, choice: Any) -> Any:
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError(f"must be none, auto, required or a named function, got {choice!r}")
        if isinstance(choice, dict) and choice.get("type") not in ("function", "allowed_tools"):
            raise ValueError(f"only {{type: function, function: {{name}}}} names a tool (or {{type: allowed_tools, "
                             f"allowed_tools: {{mode, tools}}}} a few), got type {choice.get('type')!r}")
        if isinstance(choice, dict) and choice["type"] == "allowed_tools":
            return allowed_tools_choice(choice)
        return choice

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(metadata)

    def _max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self, max_logprobs: int) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not self.logprobs:
            return None
        count = self.top_logprobs or 0
        if not 0 <= count <= max_logprobs:
            raise bad_request(f"top_logprobs must be in [0, {max_logprobs}], got {count}", "top_logprobs")
        return count


class CompletionRequest(SamplingRequest):
    prompt: list[Prompt]
    # fill-in-the-middle (text/fim.py): the text the completion goes before
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = COMPLETION

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[Prompt]:
        """A string, a list of strings, a list of token ids, or a list of token-id lists."""
        if isinstance(prompt, str):
            return [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("must be a string, a list of strings, token ids, or lists of token ids")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return prompt
        raise ValueError("must be a string, a list of strings, token ids, or non-empty lists of token ids")

    def _logprobs(self, max_logprobs: int) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise bad_request(f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}", "logprobs")
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def check_supported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if self.suffix and self.echo:  # OpenAI's insert mode answered the middle alone
            raise APIError(400, "echo is not supported with suffix: the text is the middle alone", "echo")
        if self.suffix and not all(isinstance(p, str) for p in self.prompt):
            raise APIError(400, "suffix needs the prompt as text (the prefix), not token ids", "prompt")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # rendered with messages, as /v1/chat/completions renders them
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
