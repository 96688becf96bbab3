"""The Messages API's stream: Anthropic's server-sent events, ``event: <type>`` then ``data: {json}``.

``message_start``, ``ping``, then per content block ``content_block_start``, its ``content_block_delta``
events (``thinking_delta``, ``text_delta``, ``input_json_delta``) and ``content_block_stop``; last
``message_delta`` (stop reason, usage) and ``message_stop``. An error after the first event is an
``error`` event in Anthropic's shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pluginfer.server.messages_protocol import anthropic_error_body, usage
from pluginfer.server.reasoning import ReasoningStream
from pluginfer.server.streaming import HOLE, EventTemplate, json_string, stream_response

if TYPE_CHECKING:
    from pluginfer.engine.outputs import RequestOutput
    from pluginfer.server.messages import MessageAnswer

logger = logging.getLogger(__name__)


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class MessageEvents:
    """One answer as events: content blocks open and close as the output moves from thinking to text to calls."""

    def __init__(self, answer: MessageAnswer) -> None:
        self.answer = answer
        self.reasoning = ReasoningStream(answer.reasoning()) if answer.reasoning else None
        self.tools = answer.tools.new_output() if answer.tools else None
        self.sent_text = 0
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None
        # A text delta is the event sent once a token: its JSON is written once (streaming.EventTemplate).
        self.text_delta = EventTemplate({"type": "content_block_delta", "index": HOLE,
                                         "delta": {"type": "text_delta", "text": HOLE}})

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self._stop()
        self.index += 1
        self.open = block["type"]
        return [*events, sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block})]

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _thinking(self, thinking: str) -> list[bytes]:
        events = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        return [*events, self._delta({"type": "thinking_delta", "thinking": thinking})]

    def _text(self, text: str) -> list[bytes]:
        events = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        return [*events, b"event: content_block_delta\n" + self.text_delta.fill(str(self.index), json_string(text))]

    def _calls(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """OpenAI-style ``delta.tool_calls`` entries (tools.py) as tool_use blocks and their input_json_delta."""
        events = []
        for delta in deltas:
            function = delta["function"]
            if "id" in delta:
                events += self._start({"type": "tool_use", "id": delta["id"], "name": function["name"], "input": {}})
            if function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        answer, started = self.answer, False
        async with aclosing(outputs) as stream:
            async for _, output in stream:
                [choice] = output.outputs
                if not started:
                    # at the first output: the prompt was accepted and its cached tokens are known
                    started = True
                    shell = answer.shell([], None, None, usage(output, 0))
                    yield sse("message_start", {"type": "message_start", "message": shell})
                    yield sse("ping", {"type": "ping"})
                final = choice.finish_reason is not None
                text, stop = answer.cut_stop(choice) if final else (choice.text, None)
                for event in self._step(text, final):
                    yield event
                if final:
                    for event in self._stop():
                        yield event
                    called = bool(self.tools and self.tools.sent_calls)
                    delta = {"stop_reason": answer.stop_reason(output, choice, stop, called), "stop_sequence": stop}
                    yield sse("message_delta", {"type": "message_delta", "delta": delta,
                                                "usage": usage(output, len(choice.token_ids))})
                    yield sse("message_stop", {"type": "message_stop"})

    def _step(self, text: str, final: bool) -> list[bytes]:
        events = []
        if self.reasoning is not None:
            thinking, _ = self.reasoning.delta(text, final)
            if thinking:
                events += self._thinking(thinking)
            text = self.reasoning.content
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.delta(text, final)
        else:
            content, self.sent_text = text[self.sent_text:], len(text)
        if content:
            events += self._text(content)
        return events + self._calls(calls)


async def send_events(request: web.Request, events: AsyncIterator[bytes]) -> web.StreamResponse:
    """Send each event; an error after the first is an ``error`` event in Anthropic's shape."""
    return await stream_response(request, events, lambda error: sse("error", anthropic_error_body(error)), b"")
