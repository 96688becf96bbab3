"""Anthropic's Messages API through the official ``anthropic`` SDK (strict response validation) as the client.

The oracle for the text is the chat endpoint, itself checked against the openai SDK and transformers: the
same conversation at temperature 0 gives the same text. The module gives the tiny llama's tokenizer the
ChatML template of test_tools.py, which renders tools and tool results.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from anthropic.types import message_create_params

from tests.server.conftest import API_KEY, MODEL_NAME, http, make_client
from tests.server.test_tools import SCHEMAS, WEATHER

GREEDY = {"extra_body": {"temperature": 0}}
SYSTEM = "be brief"
TURNS = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi there"},
         {"role": "user", "content": "what is new"}]
TOOLS = [{"name": "get_weather", "description": "weather now",
          "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", **WEATHER}},
         {"name": "get_time", "input_schema": SCHEMAS["get_time"], "strict": True}]
ASK = [{"role": "user", "content": "weather in Paris?"}]


pytestmark = pytest.mark.usefixtures("tool_template")


def make_anthropic(server, **kwargs) -> anthropic.Anthropic:
    kwargs.setdefault("api_key", API_KEY)
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=30, _strict_response_validation=True,
                               **kwargs)


@pytest.fixture
def claude(server):
    with make_anthropic(server) as client:
        yield client


def _chat(server, messages, **kwargs):
    with make_client(server) as client:
        return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, **kwargs)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_message_equals_the_chat_completion(server, claude):
    reply = claude.messages.create(model=MODEL_NAME, max_tokens=12, system=SYSTEM, messages=TURNS, **GREEDY)
    chat = _chat(server, [{"role": "system", "content": SYSTEM}, *TURNS], max_tokens=12)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL_NAME
    assert reply.id.startswith("msg_") and reply.stop_sequence is None
    assert _text(reply) == chat.choices[0].message.content and len(reply.content) == 1
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    # The system prompt as text blocks, the turns as blocks: the same prompt.
    blocks = [{"role": t["role"], "content": [{"type": "text", "text": t["content"]}]} for t in TURNS]
    again = claude.messages.create(model=MODEL_NAME, max_tokens=12, system=[{"type": "text", "text": SYSTEM}],
                                   messages=blocks, **GREEDY)
    assert again.content == reply.content and again.usage.cache_read_input_tokens > 0  # the prefix cache's
    count = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=TURNS)
    assert count.input_tokens == chat.usage.prompt_tokens
    # Consecutive turns of one role are one turn, as Anthropic combines them: text blocks joined by newlines.
    split = [*TURNS[:2], {"role": "user", "content": "what"}, {"role": "user", "content": [{"type": "text", "text": "is new"}]}]
    joined = [*TURNS[:2], {"role": "user", "content": "what\nis new"}]
    assert (claude.messages.count_tokens(model=MODEL_NAME, messages=split).input_tokens
            == claude.messages.count_tokens(model=MODEL_NAME, messages=joined).input_tokens
            == _chat(server, joined, max_tokens=1).usage.prompt_tokens)


def test_stream_events_build_the_same_message(server, claude):
    whole = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=TURNS, **GREEDY)
    with claude.messages.stream(model=MODEL_NAME, max_tokens=12, messages=TURNS, **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:4] == ["content_block_start", "content_block_delta", "text"] and "content_block_stop" in kinds
    assert _text(final) == _text(whole) and len(final.content) == len(whole.content) == 1
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    status, headers, raw = http(server, "POST", "/v1/messages", {"model": MODEL_NAME, "max_tokens": 4,
                                                                  "messages": TURNS, "stream": True})
    events = [block.split("\n", 1) for block in raw.decode().split("\n\n") if block]
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    names = [name.removeprefix("event: ") for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert all(json.loads(data.removeprefix("data: "))["type"] == name for name, (_, data) in zip(names, events))


def test_stop_sequences(server, claude):
    text = _text(claude.messages.create(model=MODEL_NAME, max_tokens=16, messages=TURNS, **GREEDY))
    assert len(text) > 8
    stop = text[len(text) // 2: len(text) // 2 + 2]
    reply = claude.messages.create(model=MODEL_NAME, max_tokens=16, messages=TURNS, stop_sequences=["never-seen", stop],
                                   **GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert _text(reply) == text[: text.index(stop)] == _chat(server, TURNS, max_tokens=16, stop=[stop]).choices[0].message.content
    with claude.messages.stream(model=MODEL_NAME, max_tokens=16, messages=TURNS, stop_sequences=[stop],
                                **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(reply) and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def _tool_uses(message) -> list:
    uses = [block for block in message.content if block.type == "tool_use"]
    for use in uses:
        jsonschema.validate(use.input, SCHEMAS[use.name])
    return uses


def test_tool_use_then_tool_result(server, claude):
    named = {"type": "tool", "name": "get_weather"}
    reply = claude.messages.create(model=MODEL_NAME, max_tokens=60, messages=ASK, tools=TOOLS, tool_choice=named,
                                   **GREEDY)
    [use] = _tool_uses(reply)
    assert reply.stop_reason == "tool_use" and use.name == "get_weather" and len(reply.content) == 1
    with claude.messages.stream(model=MODEL_NAME, max_tokens=60, messages=ASK, tools=TOOLS, tool_choice=named,
                                **GREEDY) as stream:
        deltas = [event.delta.partial_json for event in stream
                  if event.type == "content_block_delta" and event.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert json.loads("".join(deltas)) == use.input and final.content[0].input == use.input
    assert final.stop_reason == "tool_use"
    # The result goes back with the call: the same conversation in OpenAI's shape gives the same answer.
    result = [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]
    conversation = [*ASK, {"role": "assistant", "content": reply.content}, {"role": "user", "content": result}]
    answer = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=conversation, tools=TOOLS,
                                    tool_choice={"type": "none"}, **GREEDY)
    openai_turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]
    chat = _chat(server, openai_turns, max_tokens=12, tools=[{"type": "function", "function": {
        "name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS], tool_choice="none")
    assert _text(answer) == chat.choices[0].message.content and answer.stop_reason in ("end_turn", "max_tokens")
    count = claude.messages.count_tokens(model=MODEL_NAME, messages=conversation, tools=TOOLS)
    assert count.input_tokens == chat.usage.prompt_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_any_tool_and_parallel_switch(claude):
    reply = claude.messages.create(model=MODEL_NAME, max_tokens=120, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)
    assert reply.stop_reason == "tool_use" and len(_tool_uses(reply)) == 1


def _anthropic_error(raw: bytes, kind: str = "invalid_request_error") -> str:
    body = json.loads(raw)
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


BAD_BODIES = [
    ({"messages": TURNS, "model": MODEL_NAME}, "max_tokens"),
    ({"messages": TURNS, "model": MODEL_NAME, "max_tokens": "5"}, "max_tokens"),
    ({"messages": TURNS, "model": MODEL_NAME, "max_tokens": 5, "frobnicate": 1}, "frobnicate"),
    ({"messages": TURNS, "model": MODEL_NAME, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 2000}},
     "thinking"),
    ({"messages": TURNS, "model": MODEL_NAME, "max_tokens": 5, "stop_sequences": "x"}, "stop_sequences"),
    ({"messages": TURNS, "model": MODEL_NAME, "max_tokens": 5, "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "model": MODEL_NAME,
      "max_tokens": 5}, "messages.0.content"),
    ({"messages": [*TURNS, {"role": "assistant", "content": "pre"}], "model": MODEL_NAME, "max_tokens": 5},
     "messages.3.role"),
    ({"messages": [{"role": "system", "content": "x"}], "model": MODEL_NAME, "max_tokens": 5}, "messages.0.role"),
    ({"messages": ASK, "model": MODEL_NAME, "max_tokens": 5, "tools": TOOLS}, "tool_choice"),  # auto: no parser here
    ({"messages": ASK, "model": MODEL_NAME, "max_tokens": 5, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "x"}},
     "tool_choice"),
    ({"messages": ASK, "model": MODEL_NAME, "max_tokens": 5, "tool_choice": {"type": "any"},
      "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}]},
     "tools.0.input_schema"),
    ({"messages": ASK, "model": MODEL_NAME, "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools.0"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_requests_are_400s_in_anthropic_shape(server, claude, body, field):
    status, _, raw = http(server, "POST", "/v1/messages", body)
    assert status == 400 and field in _anthropic_error(raw), raw
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.post("/v1/messages", body=body, cast_to=anthropic.types.Message)
    assert field in error.value.message


def test_malformed_input_and_unknown_model(server, claude):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, _, raw = http(server, "POST", path, data=b'{"model": ', headers={"Content-Type": "application/json"})
        assert status == 400 and "not valid JSON" in _anthropic_error(raw)
        status, _, raw = http(server, "POST", path, [1, 2])
        assert status == 400 and "JSON object" in _anthropic_error(raw)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=4, messages=TURNS)
    with pytest.raises(anthropic.BadRequestError, match="frobnicate"):
        claude.messages.count_tokens(model=MODEL_NAME, messages=TURNS, extra_body={"frobnicate": True})
    assert claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=TURNS).usage.output_tokens >= 1


def test_api_keys_as_x_api_key_or_bearer(make_server):
    keyed = make_server(**{"server.api_keys": [API_KEY]})
    with make_anthropic(keyed, api_key="wrong") as client, pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model=MODEL_NAME, max_tokens=2, messages=TURNS)
    status, _, raw = http(keyed, "POST", "/v1/messages", {})
    assert status == 401 and "API key" in _anthropic_error(raw, "authentication_error")
    with make_anthropic(keyed) as client:  # x-api-key
        assert client.messages.count_tokens(model=MODEL_NAME, messages=TURNS).input_tokens > 0
    with make_anthropic(keyed, api_key=None, auth_token=API_KEY) as client:  # Authorization: Bearer
        assert client.messages.count_tokens(model=MODEL_NAME, messages=TURNS).input_tokens > 0


def test_every_request_field_is_honoured_or_refused(server):
    """The SDK's own list of request fields: each is served, or a 400 naming it for a value that asks for
    what this server does not do."""
    from pluginfer.server.messages_protocol import MESSAGES, MessagesRequest

    params = message_create_params.MessageCreateParamsStreaming
    fields = set(params.__required_keys__ | params.__optional_keys__)
    served = set(MessagesRequest.model_fields)
    assert fields - served - set(MESSAGES) == set()
    refused = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}, "speed": "fast",
               "container": "c", "diagnostics": {}, "inference_geo": "us", "service_tier": "priority",
               "user_profile_id": "u", "workspace_id": "w", "mcp_servers": [{}], "context_management": {}}
    assert set(MESSAGES) | {"output_config"} == set(refused)
    for name, value in refused.items():
        status, _, raw = http(server, "POST", "/v1/messages", {"model": MODEL_NAME, "max_tokens": 2,
                                                                "messages": TURNS, name: value})
        assert status == 400 and _anthropic_error(raw).startswith(name), name
    accepted = {"metadata": {"user_id": "someone"}, "service_tier": "auto", "cache_control": {"type": "ephemeral"},
                "top_p": 0.9, "top_k": 5, "temperature": 0.5}
    status, _, raw = http(server, "POST", "/v1/messages", {"model": MODEL_NAME, "max_tokens": 2, "messages": TURNS,
                                                            **accepted})
    assert status == 200, raw


def test_output_config_format_holds_the_text_to_its_schema(claude):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    output_config = {"format": {"type": "json_schema", "schema": schema}}
    reply = claude.messages.create(model=MODEL_NAME, max_tokens=60, messages=ASK, output_config=output_config)
    jsonschema.validate(json.loads(_text(reply)), schema)
    assert reply.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError, match="tool_choice any .* output_config.format"):
        claude.messages.create(model=MODEL_NAME, max_tokens=60, messages=ASK, output_config=output_config,
                               tools=TOOLS, tool_choice={"type": "any"})
    broken = {"format": {"type": "json_schema", "schema": {"type": "strng"}}}
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        claude.messages.create(model=MODEL_NAME, max_tokens=60, messages=ASK, output_config=broken)


def test_a_client_that_leaves_mid_stream_frees_its_request(claude):
    with claude.messages.stream(model=MODEL_NAME, max_tokens=200, messages=TURNS, **GREEDY) as stream:
        first = next(iter(stream))
    assert first.type == "message_start"  # closing the stream here aborts the request (the autouse fixture checks)


def test_reasoning_comes_as_thinking_blocks(make_server):
    thinking = make_server(**{"server.reasoning_parser": "deepseek_r1"})
    with make_anthropic(thinking) as client:
        reply = client.messages.create(model=MODEL_NAME, max_tokens=10, messages=TURNS, **GREEDY)
        with client.messages.stream(model=MODEL_NAME, max_tokens=10, messages=TURNS, **GREEDY) as stream:
            pieces = [event.thinking for event in stream if event.type == "thinking"]
            final = stream.get_final_message()
    chat = _chat(thinking, TURNS, max_tokens=10).choices[0].message
    # The tiny model never writes </think>: all of its output is reasoning (as the chat endpoint says).
    assert [block.type for block in reply.content] == ["thinking"] and not chat.content
    assert reply.content[0].thinking == chat.reasoning_content == "".join(pieces) == final.content[0].thinking
