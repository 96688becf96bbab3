"""The Messages API's events for outputs a tiny random model never writes (reasoning, then text, then calls in
a model's own format), read back by the ``anthropic`` SDK's own stream accumulator and event types."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent

from pluginfer.engine.outputs import CompletionOutput, RequestOutput
from pluginfer.server.messages import MessageAnswer
from pluginfer.server.messages_stream import MessageEvents
from pluginfer.server.reasoning import DeepSeekR1ReasoningParser
from pluginfer.server.tool_parsers import HermesToolParser
from pluginfer.server.tools import Tool, ToolCalling

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}})]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


def _outputs(text: str, step: int, finish_reason: str, stop: str = "") -> list[RequestOutput]:
    """The engine's outputs as the text grows ``step`` characters at a time (one token each, here)."""
    ends = [*range(step, len(text), step), len(text)]
    return [RequestOutput("msg_1", None, [1, 2, 3], [CompletionOutput(
        0, text[:end] + (stop if end == len(text) else ""), list(range(end // step + 1)), None,
        finish_reason if end == len(text) else None)], num_cached_tokens=1) for end in ends]


def _answer(reasoning: bool, tools: bool, stops: list[str] = ()) -> MessageAnswer:
    calling = ToolCalling.from_request(TOOLS, "auto", None, HermesToolParser) if tools else None
    return MessageAnswer(SimpleNamespace(model_name="m"), "msg_1", DeepSeekR1ReasoningParser if reasoning else None,
                         calling, list(stops), 100, "m")


def _streamed(answer: MessageAnswer, outputs: list[RequestOutput]) -> tuple[list[str], Message]:
    async def source():
        for output in outputs:
            yield 0, output

    async def collect() -> list[bytes]:
        return [event async for event in MessageEvents(answer).events(source())]

    kinds, snapshot, buffers = [], None, {}
    for raw in asyncio.run(collect()):
        name, data = raw.decode().removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        kinds.append(payload["type"])
        if payload["type"] != "ping":  # the SDK skips pings: they are no RawMessageStreamEvent
            event = EVENTS.validate_python(payload)
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    return kinds, Message.model_validate(snapshot.model_dump())


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_thinking_text_and_calls_stream_as_blocks(step):
    text = "<think>the user wants weather</think>I check." + CALL
    outputs = _outputs(text, step, "stop")
    kinds, streamed = _streamed(_answer(True, True), outputs)
    whole = Message.model_validate(_answer(True, True).message(outputs[-1]))
    assert [block.type for block in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.content[0].thinking == "the user wants weather" and whole.content[1].text == "I check."
    assert whole.content[2].name == "get_weather" and whole.content[2].input == {"city": "Paris"}
    assert whole.stop_reason == "tool_use" and whole.usage.input_tokens == 2 and whole.usage.cache_read_input_tokens == 1
    assert streamed.content[2].id.startswith("call_")
    for block in (*streamed.content, *whole.content):
        if block.type == "tool_use":
            block.id = "same"
    assert streamed == whole
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]


def test_stop_sequence_is_cut_and_named():
    outputs = _outputs("one two three", 2, "stop", stop="END")
    kinds, streamed = _streamed(_answer(False, False, ["END", "ND"]), outputs)
    whole = Message.model_validate(_answer(False, False, ["END", "ND"]).message(outputs[-1]))
    assert whole.content[0].text == "one two three" and whole.stop_sequence == "END"
    assert whole.stop_reason == "stop_sequence" and streamed == whole


@pytest.mark.parametrize(("finish_reason", "tokens", "expected"),
                         [("length", 100, "max_tokens"), ("length", 7, "model_context_window_exceeded"),
                          ("stop", 7, "end_turn")])
def test_stop_reasons(finish_reason, tokens, expected):
    output = RequestOutput("msg_1", None, [1], [CompletionOutput(0, "text", list(range(tokens)), None,
                                                                 finish_reason)])
    assert _answer(False, False).message(output)["stop_reason"] == expected
