"""The response object of the Responses API: its envelope, its output items and usage, built from a chat answer.

A chat message (``ChoiceText.message``: reasoning, content, tool calls) becomes output items in that order:
a ``reasoning`` item, a ``message`` item with one ``output_text`` part, one ``function_call`` item per call.
The streamed events (``responses_stream.py``) build the same items piece by piece.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pluginfer.engine.outputs import RequestOutput
from pluginfer.engine.sequence import SamplingParams
from pluginfer.server.responses_protocol import ResponsesRequest, ToolChoiceAllowed, ToolChoiceFunction


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(id_: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": id_, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status != "in_progress" else []}


def reasoning_item(id_: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": id_, "type": "reasoning", "summary": [], "content": content, "status": status}


def function_call_item(id_: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": id_, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict[str, Any], incomplete: bool) -> list[dict[str, Any]]:
    """The items of a finished chat message; cut by max_output_tokens, the last one is ``incomplete``."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(item_id("rs"), message["reasoning_content"]))
    content, calls = message.get("content"), message.get("tool_calls") or []
    if content is not None:
        # None: only calls (or a required/named choice cut before its first call)
        items.append(message_item(item_id("msg"), content))
    for call in calls:
        items.append(function_call_item(item_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"]))
    if incomplete and items:
        items[-1]["status"] = "incomplete"
    return items


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the chat message a follow-up's conversation holds (reasoning left out, as templates do)."""
    texts = [item["content"][0]["text"] for item in items if item["type"] == "message"]
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": texts[0] if texts else ("" if not calls else None)}
    if calls:
        message["tool_calls"] = calls
    return message


def usage(output: RequestOutput, reasoning_tokens: int) -> dict[str, Any]:
    prompt, generated = len(output.prompt_token_ids), sum(len(choice.token_ids) for choice in output.outputs)
    # cache_write_tokens: the prefix cache fills itself; no request writes to it explicitly.
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, generated)},
            "total_tokens": prompt + generated}


class ResponseEnvelope:
    """The response object's fields around its output: what was asked, and the status so far."""

    def __init__(self, response_id: str, body: ResponsesRequest, model_name: str, params: SamplingParams) -> None:
        self.id = response_id
        self.body, self.model_name, self.params = body, model_name, params
        self.created_at = int(time.time())

    def __call__(self, status: str, output: list[dict[str, Any]] | None = None,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        tool_choice = body.tool_choice or "auto"
        if isinstance(tool_choice, ToolChoiceFunction | ToolChoiceAllowed):
            tool_choice = tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "model": self.model_name, "output": output or [], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "service_tier": "default", "store": body.stored,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}},
            "tool_choice": tool_choice, "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "top_logprobs": 0, "truncation": "disabled", "usage": usage, "user": body.user,
            "metadata": body.metadata or {}, "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key,
        }
