"""Function tools on POST /v1/responses through the official openai client: a named call, its output sent back,
required calls streamed, allowed_tools; each the answer /v1/chat/completions gives for the same conversation."""

from __future__ import annotations

import json

import jsonschema

from tests.server.test_responses import CHAT_TOOL, GREEDY, TOOL, _chat, _check_usage
from tests.server.test_tools import WEATHER


def _call_of(response):
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    return call


def test_a_tool_call_round_trip(client, tool_template):
    """A named function's call, its output sent back (by previous_response_id, or the items themselves), and
    the next answer: each the chat answer of the same conversation."""
    first = client.responses.create(input="weather in Paris?", tools=[TOOL], max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    call = _call_of(first)
    chat_call = _chat(client, [{"role": "user", "content": "weather in Paris?"}], tools=[CHAT_TOOL],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_completion_tokens=60)
    assert call.arguments == chat_call.choices[0].message.tool_calls[0].function.arguments
    assert first.output == [call] and first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    follow = dict(tools=[TOOL], tool_choice="none", max_output_tokens=8, **GREEDY)
    by_id = client.responses.create(previous_response_id=first.id, input=[output], **follow)
    stateless = client.responses.create(input=[{"role": "user", "content": "weather in Paris?"},
                                               call.model_dump(exclude_none=True), output], **follow)
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    chat = _chat(client, history, tools=[CHAT_TOOL], tool_choice="none", max_completion_tokens=8)
    assert by_id.output_text == stateless.output_text == chat.choices[0].message.content
    _check_usage(by_id, chat)
    assert by_id.previous_response_id == first.id


def test_allowed_tools_answer_as_chat(client, tool_template):
    """tool_choice allowed_tools (the Responses form: mode and function names): the chat answer under chat's
    allowed_tools, calls only of the allowed tool; the response says the choice as it was asked."""
    from tests.server.test_tools import TIME

    tools = [TOOL, {"type": "function", "name": "get_time", "parameters": TIME}]
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    response = client.responses.create(input="weather in Paris?", tools=tools, tool_choice=choice,
                                       max_output_tokens=60, **GREEDY)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and {call.name for call in calls} == {"get_time"}
    chat = _chat(client, [{"role": "user", "content": "weather in Paris?"}], max_completion_tokens=60,
                 tools=[CHAT_TOOL, {"type": "function", "function": {"name": "get_time", "parameters": TIME}}],
                 tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                     {"type": "function", "function": {"name": "get_time"}}]}})
    assert [(c.name, c.arguments) for c in calls] == [(c.function.name, c.function.arguments)
                                                      for c in chat.choices[0].message.tool_calls]
    assert response.tool_choice.type == "allowed_tools" and response.tool_choice.mode == "required"


def test_required_calls_stream_their_arguments(client, tool_template):
    request = dict(input="weather in Paris?", tools=[TOOL], tool_choice="required", max_output_tokens=60, **GREEDY)
    whole = _call_of(client.responses.create(**request))
    events = list(client.responses.create(**request, stream=True))
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"] and added[0].arguments == ""
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == whole.arguments and done.item_id == added[0].id
    assert events[-1].type == "response.completed" and _call_of(events[-1].response).arguments == arguments
