"""The ``input`` of a Responses request as chat messages: message, function_call, function_call_output and
reasoning items, each validated on its own so an error names ``input.N.field``. Items a client echoes back from
an earlier output keep their extra keys (``id``, ``status``, ``annotations``); only text parts are served.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from pluginfer.server.errors import bad_request, from_validation_error

_TEXT_PARTS = ("input_text", "output_text", "refusal")


class _Echoed(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # output items sent back carry id, status, ...


class ContentPart(_Echoed):
    type: str
    text: str | None = None
    refusal: str | None = None

    @property
    def value(self) -> str | None:
        return self.refusal if self.type == "refusal" else self.text


def _text_only(content: str | list[ContentPart]) -> str | list[ContentPart]:
    for part in content if isinstance(content, list) else []:
        if part.type not in _TEXT_PARTS:
            raise ValueError(f"only text parts ({', '.join(_TEXT_PARTS)}) are served, got a {part.type!r} part")
        if part.value is None:
            raise ValueError(f"a {part.type} part needs {'refusal' if part.type == 'refusal' else 'text'}")
    return content


def _joined(content: str | list[ContentPart]) -> str:
    """Text parts joined by newlines, as /v1/chat/completions joins a message's parts."""
    return content if isinstance(content, str) else "\n".join(part.value or "" for part in content)


class MessageItem(_Echoed):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    _check_content = field_validator("content")(_text_only)


class FunctionCallItem(_Echoed):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Echoed):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]

    _check_output = field_validator("output")(_text_only)


class ReasoningItem(_Echoed):
    type: Literal["reasoning"]


_ITEMS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (OpenAI's chat shapes). A function call joins the assistant message before
    it, as one turn; reasoning items are left out, as chat templates leave out earlier turns' reasoning."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise bad_request(f"input.{i}: items of type {kind!r} are not served; served: {', '.join(_ITEMS)}",
                              f"input.{i}")
        try:
            item = model.model_validate(raw)
        except ValidationError as exc:
            error = from_validation_error(exc)
            raise bad_request(f"input.{i}.{error.message}", f"input.{i}.{error.param}") from None
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _joined(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)})
    return messages
