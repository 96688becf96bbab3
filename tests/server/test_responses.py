"""POST /v1/responses through the official openai client (strict response validation): each answer is the one
/v1/chat/completions gives for the same conversation, streamed as OpenAI's typed events, with tools, structured
output and previous_response_id; bad input is a 4xx in OpenAI's error shape and the server goes on serving."""

from __future__ import annotations

import asyncio
import json
import re
import time

import openai
import pydantic
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pluginfer.engine.outputs import CompletionOutput, RequestOutput
from pluginfer.engine.sequence import SamplingParams
from pluginfer.server.chat import ChoiceText
from pluginfer.server.errors import APIError
from pluginfer.server.reasoning import DeepSeekR1ReasoningParser
from pluginfer.server.responses_output import ResponseEnvelope, output_items
from pluginfer.server.responses_protocol import ResponsesRequest
from pluginfer.server.responses_stream import ResponseEvents, send_events
from pluginfer.server.tool_parsers import HermesToolParser
from pluginfer.server.tools import Tool, ToolCalling
from tests.server.conftest import MODEL_NAME, http, make_client
from tests.server.test_request_fields import SPEC, spec_fields
from tests.server.test_tools import WEATHER

INSTRUCTIONS = "be brief"
GREEDY = {"model": MODEL_NAME, "temperature": 0}
TOOL = {"type": "function", "name": "get_weather", "description": "weather now", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}}




def _chat(client, messages, **fields):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, **fields)


def _text_of(response) -> str:
    [message] = [item for item in response.output if item.type == "message"]
    assert message.role == "assistant" and [part.type for part in message.content] == ["output_text"]
    return message.content[0].text


def _check_usage(response, chat) -> None:
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def _counts(usage) -> tuple[int, int, int]:
    """The token counts (cached tokens depend on what ran before)."""
    return usage.input_tokens, usage.output_tokens, usage.total_tokens


@pytest.mark.parametrize("max_output_tokens", [3, 40])
def test_the_answer_is_the_chat_answer(client, max_output_tokens):
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "hello world"}]
    chat = _chat(client, messages, max_completion_tokens=max_output_tokens)
    response = client.responses.create(input="hello world", instructions=INSTRUCTIONS,
                                       max_output_tokens=max_output_tokens, **GREEDY)
    again = _chat(client, messages, max_completion_tokens=max_output_tokens)  # the same prompt, cached as before
    cached = response.usage.input_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens_details.cached_tokens > 0
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_NAME
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == max_output_tokens
    assert response.output_text == _text_of(response) == chat.choices[0].message.content
    _check_usage(response, chat)
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details.reason if cut else response.incomplete_details) == (
        "max_output_tokens" if cut else None)
    assert response.output[-1].status == ("incomplete" if cut else "completed")


def test_message_items_are_chat_messages(client):
    """Roles and input_text parts (joined by newlines, as chat joins text parts) as chat messages are."""
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"},
                                                            {"type": "input_text", "text": "world"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "hi", "annotations": []}]},
             {"role": "user", "content": "and?"}]
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hello\nworld"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}]
    response = client.responses.create(input=items, max_output_tokens=6, **GREEDY)
    chat = _chat(client, messages, max_completion_tokens=6)
    assert response.output_text == chat.choices[0].message.content
    _check_usage(response, chat)


def test_streamed_events_build_the_whole_response(client):
    request = dict(input="hello world", instructions=INSTRUCTIONS, max_output_tokens=12, **GREEDY)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *[d.type for d in deltas], "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", last]
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    item = events[2].item
    assert item.type == "message" and item.status == "in_progress"
    assert {d.item_id for d in deltas} == {item.id} and all(d.output_index == 0 for d in deltas)
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == events[-3].part.text == whole.output_text == final.output_text
    assert events[-2].item.id == item.id and events[-2].item.content[0].text == text
    assert _counts(final.usage) == _counts(whole.usage) and final.status == whole.status


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=6)
    kind: str = pydantic.Field(pattern="^(cat|dog)$")


def test_parse_with_a_pydantic_model_equals_chat(client):
    """The SDK's helper sends text.format from the model and parses the answer; chat's parse gets the same."""
    messages = [{"role": "user", "content": "describe a pet as JSON"}]
    parsed = client.responses.parse(input=messages, text_format=Pet, max_output_tokens=200, **GREEDY)
    chat = client.chat.completions.parse(model=MODEL_NAME, messages=messages, response_format=Pet,
                                         max_completion_tokens=200, temperature=0)
    assert isinstance(parsed.output_parsed, Pet) and parsed.output_parsed == chat.choices[0].message.parsed
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Pet"
    response = client.responses.create(input=messages, text={"format": {"type": "json_object"}},
                                       max_output_tokens=200, **GREEDY)
    chat = _chat(client, messages, max_completion_tokens=200, response_format={"type": "json_object"})
    assert response.output_text == chat.choices[0].message.content
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


def test_the_sdks_stream_helper_accumulates_the_events(client, tool_template):
    """``client.responses.stream`` rebuilds the response from the events itself (each delta into its item and part
    by index): what it rebuilds is the whole response, for text and for a function call."""
    # Each finishes (a grammar ends it): the helper wants response.completed.
    for request in (dict(input="describe a pet as JSON", text_format=Pet, max_output_tokens=200),
                    dict(input="weather in Paris?", tools=[TOOL], tool_choice="required", max_output_tokens=60)):
        whole = client.responses.parse(**request, **GREEDY)
        with client.responses.stream(**request, **GREEDY) as stream:
            texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert whole.status == final.status == "completed" and final.output_parsed == whole.output_parsed
        assert "".join(texts) == final.output_text == whole.output_text
        assert [(item.type, item.status) for item in final.output] == [(item.type, item.status) for item in whole.output]
        assert [getattr(item, "arguments", None) for item in final.output] == [
            getattr(item, "arguments", None) for item in whole.output]
        assert _counts(final.usage) == _counts(whole.usage)


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input="hello", instructions=INSTRUCTIONS, max_output_tokens=5, **GREEDY)
    second = client.responses.create(input="and then?", previous_response_id=first.id, max_output_tokens=5, **GREEDY)
    # Instructions do not carry over to the next response (OpenAI's rule).
    chat = _chat(client, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "and then?"}], max_completion_tokens=5)
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    _check_usage(second, chat)
    assert client.responses.retrieve(first.id) == first
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.create(input="x", previous_response_id=first.id, max_output_tokens=1)):
        with pytest.raises(openai.NotFoundError) as error:
            call()
        assert error.value.body["code"] == "response_not_found" and first.id in error.value.body["message"]
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_the_store_keeps_the_last_n(make_server):
    with make_client(make_server(**{"server.responses_store_size": 2})) as client:
        ids = [client.responses.create(input="hi", max_output_tokens=1, **GREEDY).id for _ in range(3)]
        unstored = client.responses.create(input="hi", max_output_tokens=1, store=False, **GREEDY)
        assert unstored.to_dict()["store"] is False
        client.responses.retrieve(ids[1])  # now the most recently used: the next one drops ids[2]
        client.responses.create(input="hi", max_output_tokens=1, **GREEDY)
        for gone in (ids[0], ids[2], unstored.id):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(gone)
        assert client.responses.retrieve(ids[1]).id == ids[1]


def test_reasoning_is_its_own_item(make_server):
    server = make_server(**{"server.reasoning_parser": "deepseek_r1"})
    with make_client(server) as client:
        request = dict(input="hello world", max_output_tokens=6, **GREEDY)
        response = client.responses.create(**request)
        chat = _chat(client, [{"role": "user", "content": "hello world"}], max_completion_tokens=6)
        events = list(client.responses.create(**request, stream=True))
    # Noise never closes </think>: all of it is reasoning, and the message is empty.
    reasoning = chat.choices[0].message.model_extra["reasoning_content"]
    assert reasoning
    assert [item.type for item in response.output] == ["reasoning", "message"] and response.output_text == ""
    assert response.output[0].content[0].text == reasoning and response.output[0].summary == []
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
    streamed = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert streamed == reasoning and [item.type for item in events[-1].response.output] == ["reasoning", "message"]


BAD = [
    (b"{not json", None, 400, None),
    (None, {"input": 5}, 400, "input"),
    (None, {"input": ["hi"]}, 400, "input"),
    (None, {"input": "hi", "tool_choice": 1}, 400, "tool_choice"),
    (None, {"input": "hi", "max_output_tokens": "5"}, 400, "max_output_tokens"),
    (None, {"input": "hi", "temperature": True}, 400, "temperature"),
    (None, {"input": "hi", "stream": "yes"}, 400, "stream"),
    (None, {"input": "hi", "no_such_field": 1}, 400, "no_such_field"),
    (None, {"input": "hi", "background": True}, 400, "background"),
    (None, {"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include"),
    (None, {"input": "hi", "truncation": "auto"}, 400, "truncation"),
    (None, {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    (None, {"input": "hi", "tools": [{"type": "function", "name": "f", "defer_loading": True}]}, 400,
     "tools.0.defer_loading"),
    (None, {"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    (None, {"input": "hi", "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "required",
                                                             "tools": [{"type": "function", "name": "nope"}]}},
     400, "tool_choice"),
    (None, {"input": "hi", "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "required",
                                                             "tools": []}}, 400, "tool_choice"),
    (None, {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}],
            "tool_choice": "required"}, 400, "tools.0.parameters"),
    (None, {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format.name"),
    (None, {"input": "hi", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
    (None, {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    (None, {"input": "hi", "reasoning": {"effort": "low"}}, 400, "reasoning.effort"),
    (None, {"input": "hi", "reasoning": {"summary": "auto"}}, 400, "reasoning.summary"),
    (None, {"input": "hi", "text": {"verbosity": "low"}}, 400, "text.verbosity"),
    (None, {"input": [{"role": "tool", "content": "x"}]}, 400, "input.0.role"),
    (None, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content"),
    (None, {"input": [{"type": "item_reference", "id": "x"}]}, 400, "input.0"),
    (None, {"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input.0.call_id"),
    (None, {"input": "hi " * 400}, 400, "input"),
    (None, {}, 400, "input"),
    (None, {"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    (None, {"input": "hi", "model": "other"}, 404, "model"),
]


@pytest.mark.parametrize(("data", "body", "status", "param"), BAD)
def test_bad_input_is_a_4xx_in_openais_shape(server, data, body, status, param):
    got, _, raw = http(server, "POST", "/v1/responses", body=body, data=data,
                       headers={"Content-Type": "application/json"})
    error = json.loads(raw)["error"]
    assert got == status and error["param"] == param and error["message"], raw
    assert error["type"] == "invalid_request_error"
    got, _, raw = http(server, "POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1})
    assert got == 200 and json.loads(raw)["status"] in ("completed", "incomplete")


def test_unknown_ids_and_query_parameters(server):
    for method in ("GET", "DELETE"):
        status, _, raw = http(server, method, "/v1/responses/resp_nope")
        assert status == 404 and json.loads(raw)["error"]["code"] == "response_not_found"
    status, _, raw = http(server, "POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1})
    response_id = json.loads(raw)["id"]
    status, _, raw = http(server, "GET", f"/v1/responses/{response_id}?stream=true")
    assert status == 400 and json.loads(raw)["error"]["param"] == "stream"


# The fields of OpenAI's CreateResponse schema (shared/data/openai-openapi.json), and the test that shows each
# one honoured, or a value that is refused.
CREATE_RESPONSE_FIELDS = [
    "background", "context_management", "conversation", "include", "input", "instructions", "max_output_tokens",
    "max_tool_calls", "metadata", "model", "moderation", "parallel_tool_calls", "previous_response_id", "prompt",
    "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning", "safety_identifier",
    "service_tier", "store", "stream", "stream_options", "temperature", "text", "tool_choice", "tools",
    "top_logprobs", "top_p", "truncation", "user"]
HONOURED = {"input", "instructions", "max_output_tokens", "model", "parallel_tool_calls", "previous_response_id",
            "reasoning", "store", "stream", "stream_options", "temperature", "text", "tool_choice", "tools", "top_p"}
INFORMATIONAL = {"metadata": {"k": "v"}, "prompt_cache_key": "k", "safety_identifier": "s", "user": "u"}
REFUSED = {"background": True, "context_management": [{"type": "compaction"}], "conversation": "conv_1",
           "include": ["reasoning.encrypted_content"], "max_tool_calls": 3, "moderation": {"model": "m"},
           "prompt": {"id": "pmpt_1"}, "prompt_cache_options": {"ttl": "30m"}, "prompt_cache_retention": "24h",
           "service_tier": "flex", "top_logprobs": 2, "truncation": "auto"}


def test_every_spec_field_is_honoured_or_refused(server):
    if SPEC.is_file():
        assert spec_fields(json.loads(SPEC.read_text()), "CreateResponse") == CREATE_RESPONSE_FIELDS
    assert set(CREATE_RESPONSE_FIELDS) == HONOURED | set(INFORMATIONAL) | set(REFUSED)
    for field, value in REFUSED.items():
        status, _, raw = http(server, "POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1, field: value})
        assert status == 400 and json.loads(raw)["error"]["param"] == field, (field, raw)
    for field, value in {**INFORMATIONAL, "stream": False,
                         "store": True, "top_p": 0.5, "parallel_tool_calls": False, "service_tier": "auto",
                         "truncation": "disabled", "include": []}.items():
        status, _, raw = http(server, "POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1, field: value})
        assert status == 200, (field, raw)
        if field in INFORMATIONAL:
            assert json.loads(raw)[field] == value
    body = {"input": "hi", "max_output_tokens": 1, "stream": True, "stream_options": {"include_obfuscation": False}}
    status, _, raw = http(server, "POST", "/v1/responses", body)
    assert status == 200 and raw.rstrip().split(b"\n")[-2] in (b"event: response.completed",
                                                               b"event: response.incomplete"), raw
    for fields, param in (({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
                          ({"stream": False}, "stream_options")):  # stream_options without a stream
        status, _, raw = http(server, "POST", "/v1/responses", {**body, **fields})
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


def test_a_client_that_leaves_mid_stream_aborts_its_request(server, client):
    """A grammar that holds the output open for 150 characters: the request still runs when the client leaves
    after the first delta; the server counts a 499 and every KV block is free again (the autouse fixture)."""
    def left() -> float:
        text = http(server, "GET", "/metrics")[2].decode()
        found = re.search(r'^pluginfer_requests_total\{route="/v1/responses",status="499"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    before = left()
    text = {"format": {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 150}}}
    with client.responses.create(input="hi", text=text, max_output_tokens=200, stream=True, **GREEDY) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    deadline = time.monotonic() + 10
    while left() == before:
        assert time.monotonic() < deadline, "the request was not counted as a client that left"
        time.sleep(0.02)


def _served_events(outputs, text: ChoiceText, finished: list) -> tuple[int, list[dict]]:
    """(status, event payloads) of ResponseEvents over ``outputs`` served by a bare aiohttp app."""
    async def handler(request: web.Request) -> web.StreamResponse:
        envelope = ResponseEnvelope("resp_1", ResponsesRequest.model_validate({"input": "hi"}), MODEL_NAME,
                                    SamplingParams())
        return await send_events(request, ResponseEvents(envelope, text, False, len, finished.append), outputs)

    async def main() -> tuple[int, bytes]:
        app = web.Application()
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app)) as http_client:
            response = await http_client.post("/")
            return response.status, await response.read()

    status, raw = asyncio.run(main())
    events = [block.split("\n") for block in raw.decode().strip().split("\n\n")]
    payloads = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert [lines[0] for lines in events] == [f"event: {payload['type']}" for payload in payloads]
    assert [payload["sequence_number"] for payload in payloads] == list(range(len(payloads)))
    return status, payloads


def _growing(text: str, step: int = 3):
    """Engine outputs whose text grows ``step`` characters at a time, the last one finished."""
    async def outputs():
        for end in range(step, len(text) + step, step):
            done = end >= len(text)
            yield 0, RequestOutput("r", None, [1, 2], [CompletionOutput(0, text[:end], [3] * end, None,
                                                                        "stop" if done else None)], finished=done)
    return outputs()


HERMES_TEXT = 'I check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.mark.parametrize("think", ["", "<think>cold or warm?</think>"])
def test_streamed_items_of_text_reasoning_and_a_call_are_the_whole_answers(think):
    """A model's own call format (hermes, read under tool_choice auto) after text and reasoning, streamed a few
    characters at a time: the items the events build are the ones the whole answer has."""
    tools = ToolCalling.from_request([Tool.model_validate(CHAT_TOOL)], "auto", None, HermesToolParser)
    reasoning = DeepSeekR1ReasoningParser if think else None
    finished: list = []
    status, events = _served_events(_growing(think + HERMES_TEXT), ChoiceText(reasoning, tools), finished)
    whole = output_items(ChoiceText(reasoning, tools).message(think + HERMES_TEXT), incomplete=False)

    def shape(item: dict) -> tuple:
        return item["type"], item["status"], item.get("content"), item.get("name"), item.get("arguments")

    final = events[-1]
    assert status == 200 and final["type"] == "response.completed" and finished == [final["response"]]
    assert [shape(item) for item in final["response"]["output"]] == [shape(item) for item in whole]
    assert [item["type"] for item in whole] == ["reasoning"] * bool(think) + ["message", "function_call"]
    added = [event["item"] for event in events if event["type"] == "response.output_item.added"]
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert [item["id"] for item in added] == [item["id"] for item in done] == [
        item["id"] for item in final["response"]["output"]]
    texts = {kind: "".join(event["delta"] for event in events if event["type"] == kind)
             for kind in ("response.reasoning_text.delta", "response.output_text.delta",
                          "response.function_call_arguments.delta")}
    assert texts == {"response.reasoning_text.delta": think.removeprefix("<think>").removesuffix("</think>"),
                     "response.output_text.delta": "I check.",
                     "response.function_call_arguments.delta": whole[-1]["arguments"]}


def test_an_error_after_the_first_event_is_an_error_event():
    """The engine fails after its first output: the stream so far, then one ``error`` event in OpenAI's shape."""
    async def outputs():
        yield 0, RequestOutput("r", None, [1, 2], [CompletionOutput(0, "Hello", [3], None, None)])
        raise APIError(500, "the engine step running this request failed", code="engine_step_failed")

    finished: list = []
    status, payloads = _served_events(outputs(), ChoiceText(None, None), finished)
    assert status == 200 and not finished  # a failed response is not stored
    assert [p["type"] for p in payloads] == ["response.created", "response.in_progress", "response.output_item.added",
                                             "response.content_part.added", "response.output_text.delta", "error"]
    assert payloads[-1] == {"type": "error", "code": "engine_step_failed", "param": None, "sequence_number": 5,
                            "message": "the engine step running this request failed"}
