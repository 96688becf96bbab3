"""Constrained tool arguments hold only declared keys, with schemas exactly as LangChain and the openai SDK
send them (no ``additionalProperties``), on random weights that try every key the grammar lets them.

The oracle is ``jsonschema`` on the schema with ``additionalProperties: false`` written into every object,
as OpenAI's strict mode requires it to be sent.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI

from tests.engine.test_strict_schema import Forecast, closed, get_weather
from tests.server.conftest import API_KEY, MODEL_NAME, make_client

SEEDS = [1, 2, 3, 4]
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]


pytestmark = pytest.mark.usefixtures("tool_template")


def check_arguments(arguments: dict[str, Any], parameters: dict[str, Any]) -> None:
    jsonschema.validate(arguments, closed(parameters))


def _langchain(server, seed: int) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL_NAME, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=1.0, seed=seed,
                      max_tokens=180, max_retries=0, timeout=30)


@pytest.mark.parametrize("seed", SEEDS)
def test_langchain_bind_tools_named(server, seed):
    """The issue's call: bind_tools with the function named; the arguments hold only ``city``."""
    message = _langchain(server, seed).bind_tools([get_weather], tool_choice="get_weather").invoke(MESSAGES)
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    check_arguments(call["args"], convert_to_openai_tool(get_weather)["function"]["parameters"])


@pytest.mark.parametrize("seed", SEEDS)
def test_langchain_bind_tools_required(server, seed):
    tools = [get_weather, Forecast]
    # One call (maxItems 1): an array of calls on random weights would outrun the tiny context.
    message = _langchain(server, seed).bind_tools(tools, tool_choice="required", parallel_tool_calls=False).invoke(
        MESSAGES)
    assert message.tool_calls and not message.invalid_tool_calls
    schemas = {spec["function"]["name"]: spec["function"]["parameters"] for spec in map(convert_to_openai_tool, tools)}
    for call in message.tool_calls:
        check_arguments(call["args"], schemas[call["name"]])


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
@pytest.mark.parametrize("seed", SEEDS)
def test_langchain_with_structured_output(server, method, seed):
    runnable = _langchain(server, seed).with_structured_output(Forecast, method=method, include_raw=True)
    result = runnable.invoke(MESSAGES)
    assert result["parsing_error"] is None and isinstance(result["parsed"], Forecast)
    raw = result["raw"]
    if method == "function_calling":
        [call] = raw.tool_calls
        arguments = call["args"]
        parameters = convert_to_openai_tool(Forecast)["function"]["parameters"]
    else:  # the SDK's strict schema from the model, sent as response_format
        arguments = json.loads(raw.content)
        parameters = Forecast.model_json_schema()
    check_arguments(arguments, parameters)


@pytest.mark.parametrize("seed", SEEDS)
def test_openai_client_named_and_required(client, seed):
    """The official client, tools as openai.pydantic_function_tool and LangChain's converter make them."""
    tools = [openai.pydantic_function_tool(Forecast, name="forecast"), convert_to_openai_tool(get_weather)]
    schemas = {spec["function"]["name"]: spec["function"]["parameters"] for spec in tools}
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=tools, tool_choice=choice,
                                                  parallel_tool_calls=False, max_tokens=180, temperature=1.0,
                                                  seed=seed, n=2)
        for answer in response.choices:
            assert answer.finish_reason == "tool_calls"
            for call in answer.message.tool_calls:
                check_arguments(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("seed", SEEDS)
def test_response_format_strict_closes_objects(client, seed):
    """``strict: true`` with a schema that leaves additionalProperties out (OpenAI would refuse it): closed."""
    parameters = convert_to_openai_tool(Forecast)["function"]["parameters"]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=220, temperature=1.0, seed=seed, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": parameters,
                                                                "strict": True}})
    for answer in response.choices:
        assert answer.finish_reason == "stop"
        check_arguments(json.loads(answer.message.content), parameters)


def test_lenient_schemas_when_the_server_says_so(make_server):
    """``server.strict_tool_schemas: false``: llguidance's reading of JSON Schema, where undeclared keys may come
    (on random weights they do, and their unbounded names run the call into max_tokens)."""
    parameters = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    keys: dict[bool, list[Any]] = {}
    for strict in (True, False):
        with make_client(make_server(**{"server.strict_tool_schemas": strict})) as client:
            response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=tools, n=8,
                                                      tool_choice=named, max_tokens=40, temperature=1.0, seed=5)
        keys[strict] = [_keys(choice.message.tool_calls[0].function.arguments) for choice in response.choices]
    assert all(found == {"unit"} for found in keys[True])
    assert any(found != {"unit"} for found in keys[False]), keys


def _keys(arguments: str) -> set[str] | None:
    try:
        return set(json.loads(arguments))
    except ValueError:
        return None  # cut short by max_tokens
