"""The Responses API's event stream: ``event: <type>`` / ``data: {json}`` pairs, numbered by ``sequence_number``.

``response.created`` and ``response.in_progress`` come with the engine's first output (so an error known
before it, such as a prompt longer than the context, is still an HTTP 400); then each output item opens
(``response.output_item.added``, ``response.content_part.added``), grows (``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``) and closes (its ``.done``
events); ``response.completed`` (or ``response.incomplete``, cut by max_output_tokens) ends the stream.
An error after the first event is one ``error`` event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from pluginfer.engine.outputs import RequestOutput
from pluginfer.server.chat import ChoiceText
from pluginfer.server.errors import APIError
from pluginfer.server.responses_output import (
    ResponseEnvelope,
    function_call_item,
    item_id,
    message_item,
    reasoning_item,
    text_part,
    usage,
)
from pluginfer.server.responses_protocol import in_responses_terms
from pluginfer.server.streaming import HOLE, EventTemplate, json_string, stream_response

logger = logging.getLogger(__name__)


def _template(kind: str, **fields: Any) -> EventTemplate:
    template = EventTemplate({"type": kind, **fields, "sequence_number": HOLE})
    template.parts[0] = f"event: {kind}\n" + template.parts[0]
    return template


class ResponseEvents:
    """The events of one response, from the chat answer's deltas; ``finish`` gets the finished body."""

    def __init__(self, envelope: ResponseEnvelope, text: ChoiceText, constrained: bool,
                 reasoning_tokens: Callable[[str], int], finish: Callable[[dict[str, Any]], None]) -> None:
        self.envelope, self.text, self.constrained = envelope, text, constrained
        self.reasoning_tokens, self.finish = reasoning_tokens, finish
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output: finished items, then the open one
        self.open: dict[str, Any] | None = None
        # the open item's text (or arguments) so far, joined when it closes
        self.pieces: list[str] = []
        self.delta_templates: dict[str, EventTemplate] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    def _delta(self, kind: str, delta: str) -> bytes:
        """A text delta of the open item: filled in from a template, once a token."""
        item = self.open
        assert item is not None
        template = self.delta_templates.get(item["id"] + kind)
        if template is None:
            fields: dict[str, Any] = {"item_id": item["id"], "output_index": len(self.items) - 1}
            if kind != "response.function_call_arguments.delta":
                fields["content_index"] = 0
            fields["delta"] = HOLE
            if kind == "response.output_text.delta":
                fields["logprobs"] = []
            template = self.delta_templates[item["id"] + kind] = _template(kind, **fields)
        self.sequence += 1
        return template.fill(json_string(delta), str(self.sequence - 1))

    def error(self, error: APIError) -> bytes:
        shape = error.body()["error"]  # OpenAI's error fields; its type where there is no code
        return self._event("error", code=shape["code"] or shape["type"], message=shape["message"], param=shape["param"])

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.open, self.pieces = item, []
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=text_part("")))
        elif item["type"] == "reasoning":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        return events

    def _close(self, status: str = "completed") -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, id_, text = len(self.items) - 1, item["id"], "".join(self.pieces)
        if item["type"] == "message":
            item.update(message_item(id_, text, status))
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=id_, output_index=index, content_index=0,
                                  text=text, logprobs=[]),
                      self._event("response.content_part.done", item_id=id_, output_index=index, content_index=0,
                                  part=part)]
        elif item["type"] == "reasoning":
            item.update(reasoning_item(id_, text, status))
            events = [self._event("response.reasoning_text.done", item_id=id_, output_index=index, content_index=0,
                                  text=text),
                      self._event("response.content_part.done", item_id=id_, output_index=index, content_index=0,
                                  part=item["content"][0])]
        else:
            item.update(arguments=text, status=status)
            events = [self._event("response.function_call_arguments.done", item_id=id_, output_index=index,
                                  name=item["name"], arguments=item["arguments"])]
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]

    def _apply(self, delta: dict[str, Any]) -> list[bytes]:
        """Events for one chat delta: reasoning first, then content, then calls (the order of the items)."""
        events: list[bytes] = []
        for key, kind, make in (("reasoning_content", "reasoning", reasoning_item), ("content", "message", message_item)):
            piece = delta.get(key)
            if not piece:
                continue
            if self.open is None or self.open["type"] != kind:
                events += self._open(make(item_id("rs" if kind == "reasoning" else "msg"), "", "in_progress"))
            self.pieces.append(piece)
            events.append(self._delta("response.reasoning_text.delta" if kind == "reasoning"
                                      else "response.output_text.delta", piece))
        for call in delta.get("tool_calls", []):
            function = call.get("function", {})
            if "id" in call:
                events += self._open(function_call_item(item_id("fc"), call["id"], function["name"], "", "in_progress"))
            arguments = function.get("arguments")
            if arguments and self.open is not None:
                self.pieces.append(arguments)
                events.append(self._delta("response.function_call_arguments.delta", arguments))
        return events

    async def stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        last: RequestOutput | None = None
        with in_responses_terms():
            async with aclosing(outputs) as source:
                async for _, output in source:
                    if not output.outputs:
                        continue
                    if last is None:
                        yield self._event("response.created", response=self.envelope("in_progress"))
                        yield self._event("response.in_progress", response=self.envelope("in_progress"))
                    last = output
                    choice = output.outputs[0]
                    for event in self._apply(self.text.delta(choice.text, final=choice.finish_reason is not None)):
                        yield event
        assert last is not None
        incomplete = last.outputs[0].finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        called = any(item["type"] == "function_call" for item in self.items)
        if not self.constrained and not called and not any(item["type"] == "message" for item in self.items):
            for event in self._open(message_item(item_id("msg"), "", "in_progress")):
                # an answer with no text is still a message, as the whole response has
                yield event
        for event in self._close("incomplete" if incomplete else "completed"):
            yield event
        reasoning = "".join(item["content"][0]["text"] for item in self.items if item["type"] == "reasoning")
        body = self.envelope(status, self.items, usage(last, self.reasoning_tokens(reasoning)))
        self.finish(body)
        yield self._event(f"response.{status}", response=body)


async def send_events(request: web.Request, events: ResponseEvents,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> web.StreamResponse:
    """Send the events; an error after the first is an ``error`` event in the Responses API's shape."""
    return await stream_response(request, events.stream(outputs), events.error, b"")
