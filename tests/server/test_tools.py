"""Tool calling through the official openai client (strict validation), sync, async and streamed.

The tiny llama's own template renders no tools, so these tests give its tokenizer a ChatML template
that does (Qwen2.5's layout, shortened to fit the 256-token context) for the module.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pydantic
import pytest

from pluginfer.server.core_client import CoreProcessClient
from tests.server.conftest import MODEL_NAME, http, make_async_client, make_client

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["utc", "cet"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES_TEXT = 'I check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


pytestmark = pytest.mark.usefixtures("tool_template")


@pytest.fixture(scope="module")
def hermes_server(make_server):
    return make_server(**{"server.tool_call_parser": "hermes"})


def _check_calls(tool_calls, names=None) -> list[tuple[str, dict]]:
    calls = []
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    assert len({call.id for call in tool_calls}) == len(tool_calls)
    if names is not None:
        assert [name for name, _ in calls] == names
    return calls


def _streamed_calls(chunks) -> tuple[str, dict[int, dict], list[str]]:
    """(content, {index: {id, name, arguments}}, finish reasons) from delta.tool_calls pieces."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            if piece.id is not None:
                assert entry["id"] is None and piece.type == "function"  # id and type come once, first
                entry["id"] = piece.id
            if piece.function is not None:
                entry["name"] += piece.function.name or ""
                entry["arguments"] += piece.function.arguments or ""
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    return content, calls, reasons


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_function_is_called_with_valid_arguments(client, temperature):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                              max_tokens=100, temperature=temperature, seed=3, n=2)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls, ["get_weather"])


def test_named_function_streams_its_arguments(server, client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=100, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                                 tool_choice=NAMED, max_tokens=100, temperature=0, stream=True))
    content, calls, reasons = _streamed_calls(chunks)
    [call] = whole.choices[0].message.tool_calls
    assert content == "" and reasons == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    if isinstance(server.engine, CoreProcessClient):
        # Through the engine core process a request's deltas of several steps are merged into one event when the
        # HTTP side is behind the core (by design, as vLLM's output processor does: a server never queues stale
        # per-token events). How many events a stream gets there depends on the timing of this tiny model's ~1 ms
        # steps against the test's own client on the same cores (one event in some runs, CI saw it), so the
        # count is not asserted on this path: the reassembled call above is; the deltas' growth itself is
        # tests/server/test_tool_parsers.py's, and the merge is test_client_request.py's.
        return
    # In-process every step's output is queued to the stream: the name, then the arguments as they grow.
    pieces = sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].delta.tool_calls)
    assert pieces > 2


# Parallel calls are an unbounded array: sampled random weights may go on adding calls, greedy ones stop.
@pytest.mark.parametrize(("parallel", "temperature", "n"), [(True, 0.0, 1), (False, 1.0, 3)])
def test_required_calls_validate_against_their_tools(client, parallel, temperature, n):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                              tool_choice="required", parallel_tool_calls=parallel, max_tokens=150,
                                              temperature=temperature, seed=1, n=n)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        calls = _check_calls(choice.message.tool_calls)
        assert 1 <= len(calls) <= (8 if parallel else 1)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=parallel, max_tokens=150, temperature=temperature,
                                            seed=1, stream=True)
    _, calls, reasons = _streamed_calls(stream)
    first = response.choices[0].message.tool_calls
    assert reasons == ["tool_calls"] and [c["name"] for c in calls.values()] == [c.function.name for c in first]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [json.loads(c.function.arguments) for c in first]


def test_allowed_tools_keep_every_tool_in_the_prompt_and_call_only_theirs(client, hermes_server):
    """tool_choice allowed_tools (OpenAI's): the prompt is the one with every tool, the calls only the allowed
    tools' (mode required: sampled choices that, with every tool allowed, call both); mode auto holds a call
    once the parser's trigger appears, and refuses a request whose output format rules its grammar out."""
    def required(choice) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                              max_tokens=150, temperature=1.0, seed=3, n=6)

    only_time = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    every, allowed = required("required"), required(only_time)
    assert {name for c in every.choices for name, _ in _check_calls(c.message.tool_calls)} == {"get_weather",
                                                                                                 "get_time"}
    assert allowed.usage.prompt_tokens == every.usage.prompt_tokens  # both tools rendered
    for choice in allowed.choices:
        assert choice.finish_reason == "tool_calls"
        assert {name for name, _ in _check_calls(choice.message.tool_calls)} == {"get_time"}
    auto_time = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    with make_client(hermes_server) as hermes:
        answer = hermes.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                                tool_choice=auto_time, max_tokens=20, temperature=0)
        assert answer.choices[0].message.tool_calls is None or {
            name for name, _ in _check_calls(answer.choices[0].message.tool_calls)} == {"get_time"}
    status, _, raw = http(hermes_server, "POST", "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, "tool_choice": auto_time,
        "structured_outputs": {"choice": [HERMES_TEXT]}})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "tool_choice" and "use mode required" in error["message"], error


def test_required_cut_by_max_tokens_returns_the_partial_call(client):
    """Cut by max_tokens, ``required`` answers "length" with the calls as far as they came, never its internal
    array as content: greedy, a cut output is a prefix of the whole one, so each call is the whole answer's
    call and the last one's arguments a prefix of that call's."""
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**request, max_tokens=150)
    [full] = whole.choices
    expected = [(call.function.name, call.function.arguments) for call in full.message.tool_calls]
    length = whole.usage.completion_tokens
    for max_tokens in (3, length // 2, length - 2):
        answer = client.chat.completions.create(**request, max_tokens=max_tokens).choices[0]
        streamed, deltas, reasons = _streamed_calls(client.chat.completions.create(**request, max_tokens=max_tokens,
                                                                                     stream=True))
        assert answer.finish_reason == "length" and reasons == ["length"]
        assert answer.message.content is None and streamed == ""
        calls = [(call.function.name, call.function.arguments) for call in answer.message.tool_calls or []]
        assert [(c["name"], c["arguments"]) for c in deltas.values()] == calls
        assert len(calls) <= len(expected) and (calls or max_tokens == 3), (max_tokens, calls)
        for i, (name, arguments) in enumerate(calls):
            assert name == expected[i][0]
            assert expected[i][1].startswith(arguments) and (arguments == expected[i][1] or i == len(calls) - 1)


def test_auto_answer_cut_after_a_call_says_length(hermes_server):
    """An answer cut by max_tokens says "length" though it carries a complete call (docs/server.md)."""
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0,
                   extra_body={"structured_outputs": {"choice": [HERMES_TEXT + " Then I tell you what it says."]}})
    with make_client(hermes_server) as client:
        whole = client.chat.completions.create(**request, max_tokens=100)
        assert whole.choices[0].finish_reason == "tool_calls"
        cut = client.chat.completions.create(**request, max_tokens=whole.usage.completion_tokens - 3).choices[0]
        content, calls, reasons = _streamed_calls(client.chat.completions.create(
            **request, max_tokens=whole.usage.completion_tokens - 3, stream=True))
    assert cut.finish_reason == "length" and reasons == ["length"]
    assert cut.message.content == content == "I check."
    assert _check_calls(cut.message.tool_calls) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]


class Item(pydantic.BaseModel):
    sku: str = pydantic.Field(max_length=4)
    count: int = pydantic.Field(ge=1, le=9)


class PlaceOrder(pydantic.BaseModel):
    """Place an order."""

    items: list[Item] = pydantic.Field(max_length=2)
    express: bool


def test_required_call_of_a_pydantic_tool_parses(client):
    """The SDK's strict tool from a pydantic model (nested models as $defs), read back by ``parse``."""
    tool = openai.pydantic_function_tool(PlaceOrder)
    assert "$defs" in tool["function"]["parameters"]
    completion = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, tools=[tool],
                                               tool_choice="required", parallel_tool_calls=False, max_tokens=150,
                                               temperature=0)
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "PlaceOrder" and isinstance(call.function.parsed_arguments, PlaceOrder)


def test_auto_reads_the_models_own_format(hermes_server):
    """The text a Qwen model writes, forced by a grammar since random weights never write it."""
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0,
                   extra_body={"structured_outputs": {"choice": [HERMES_TEXT]}})
    with make_client(hermes_server) as client:
        response = client.chat.completions.create(**request)
        [choice] = response.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == "I check."
        assert _check_calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris", "unit": "c"})]
        content, calls, reasons = _streamed_calls(client.chat.completions.create(**request, stream=True))
        assert content == "I check." and reasons == ["tool_calls"]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("get_weather", {"city": "Paris", "unit": "c"})]

    async def plain_text() -> tuple[str | None, object, str]:
        async with make_async_client(hermes_server) as client:
            response = await client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=30, temperature=0,
                extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
            choice = response.choices[0]
            return choice.message.content, choice.message.tool_calls, choice.finish_reason

    assert asyncio.run(plain_text()) == ("It is sunny.", None, "stop")


def test_tool_results_go_back_into_the_prompt(server, client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    response = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none",
                                              max_tokens=4, temperature=0)
    assert response.choices[0].message.tool_calls is None and response.choices[0].finish_reason in ("stop", "length")
    tokens = json.loads(http(server, "POST", "/tokenize", {"messages": history})[2])["tokens"]
    prompt = json.loads(http(server, "POST", "/detokenize", {"tokens": tokens})[2])["prompt"]
    # The arguments reach the template as an object, not as a JSON string inside JSON.
    assert '"arguments": {"city": "Paris", "unit": "c"}' in prompt and "<tool_response>18 C, sunny" in prompt


def test_tool_choice_none_renders_the_tools_and_parses_nothing(client):
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0)
    with_tools = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                max_tokens=3, temperature=0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
    assert with_tools.choices[0].message.tool_calls is None and with_tools.choices[0].message.content


BAD_PARAMETERS = {"type": "object", "properties": {"city": {"type": "strng"}}}


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_PARAMETERS}}],
      "tool_choice": "required"}, "tools.0.function.parameters", "strng"),
    ({"tools": TOOLS + [{"type": "function", "function": {"name": "g", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools.2.function.parameters", "type object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "none were given"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice", "mode"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}}},
     "tool_choice", "at least 1"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "none", "tools": [NAMED]}}},
     "tool_choice", "mode"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "nope"}}]}}},
     "tool_choice", "tool_choice.allowed_tools.tools.0: no tool named 'nope'"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [NAMED]}}},
     "tool_choice", "--tool-call-parser"),  # auto, and this server has no parser
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [NAMED]}},
      "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"tools": TOOLS}, "tool_choice", "--tool-call-parser"),  # auto, and this server has no parser
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "unique"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"},
     "tools.0.function.name", "pattern"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
])
def test_tools_that_cannot_be_served_are_400(server, fields, param, says):
    status, _, raw = http(server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **fields})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and says in error["message"], error


def test_a_template_without_tools_is_400(server, async_engine):
    tokenizer = async_engine.tokenizer
    tokenizer.chat_template, kept = "{% for m in messages %}{{ m.content }}{% endfor %}", tokenizer.chat_template
    try:
        status, _, raw = http(server, "POST", "/v1/chat/completions",
                              {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"})
    finally:
        tokenizer.chat_template = kept
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "tools" and "does not render tools" in error["message"]


def test_tokenize_renders_tools_as_chat_does(server, client):
    """/tokenize with messages and tools counts the prompt /v1/chat/completions builds for them."""
    status, _, raw = http(server, "POST", "/tokenize", {"messages": MESSAGES, "tools": TOOLS})
    assert status == 200, raw
    with_tools = json.loads(raw)["tokens"]
    plain = json.loads(http(server, "POST", "/tokenize", {"messages": MESSAGES})[2])["tokens"]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens == len(with_tools) > len(plain)
    status, _, raw = http(server, "POST", "/detokenize", {"tokens": with_tools})
    assert "tools: get_weather get_time" in json.loads(raw)["prompt"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "tools": TOOLS}, "tools"),  # tools are rendered with messages only
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools.0.function.parameters"),
    ({"messages": MESSAGES, "tools": TOOLS + TOOLS[:1]}, "tools"),  # a name twice
])
def test_tokenize_refuses_tools_it_cannot_render(server, body, param):
    status, _, raw = http(server, "POST", "/tokenize", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw
