"""strict_json_schema: every object without additionalProperties is closed, checked with ``jsonschema`` against
an oracle that writes ``additionalProperties: false`` into every object (as OpenAI's strict mode requires it
sent), on schemas exactly as LangChain and the openai SDK make them. The server side:
``tests/server/test_strict_tool_schemas.py``."""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool

from pluginfer.engine.strict_schema import strict_json_schema


@tool
def get_weather(city: Annotated[str, pydantic.Field(max_length=8)]) -> str:
    """Weather in a city."""
    return city


class Unit(str, enum.Enum):
    c = "c"
    f = "f"


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=6)
    country: Literal["no", "fr"] | None = None


class Forecast(pydantic.BaseModel):
    """A forecast request (bounded values, so that random weights close it within the tiny context)."""

    place: Place
    unit: Unit
    days: list[Annotated[int, pydantic.Field(ge=0, le=9)]] = pydantic.Field(max_length=2)
    other: Place | None = None


def closed(schema: Any) -> Any:
    """The oracle: ``additionalProperties: false`` on every object schema that leaves it out."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (closed(value) if key not in ("enum", "const", "default") else value)
           for key, value in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def test_the_langchain_schema_is_what_the_issue_reported():
    """The schema LangChain sends says nothing of additionalProperties (so JSON Schema leaves objects open)."""
    parameters = convert_to_openai_tool(get_weather)["function"]["parameters"]
    assert parameters == {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"]}
    jsonschema.validate({"city": "Oslo", "name": "get_weather"}, parameters)  # open: the undeclared key passes
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Oslo", "name": "get_weather"}, strict_json_schema(parameters))


@pytest.mark.parametrize("schema", [
    convert_to_openai_tool(get_weather)["function"]["parameters"],
    convert_to_openai_tool(Forecast)["function"]["parameters"],
    openai.pydantic_function_tool(Forecast)["function"]["parameters"],
    Forecast.model_json_schema(),
])
def test_strict_schema_equals_the_oracle_on_what_it_accepts(schema):
    """Same documents accepted as the oracle's closed schema; the input is left as it was."""
    before = json.dumps(schema, sort_keys=True)
    strict = strict_json_schema(schema)
    assert json.dumps(schema, sort_keys=True) == before
    good = {"city": "Oslo", "place": {"city": "Oslo", "country": "no"}, "unit": "c", "days": [1],
            "other": {"city": "x", "country": None}}
    for document in (good, {**good, "extra": 1}, {**good, "place": {"city": "Oslo", "zip": 1}},
                     {**good, "other": {"city": "x", "z": 0}}):
        expected = jsonschema.Draft202012Validator(closed(schema)).is_valid(document)
        assert jsonschema.Draft202012Validator(strict).is_valid(document) == expected, document


def test_allof_branches_keep_each_others_keys():
    """An object built by allOf is closed over the names its branches declare, not branch by branch."""
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    strict = jsonschema.Draft202012Validator(strict_json_schema(schema))
    assert strict.is_valid({"a": 1, "b": 2}) and not strict.is_valid({"a": 1, "c": 3})
    assert not strict.is_valid({"a": "x"})  # the branches still say what each key holds


def test_anyof_inside_an_object_adds_its_branches_keys():
    schema = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}},
              "anyOf": [{"properties": {"x": {"type": "integer"}}}, {"properties": {"y": {"type": "integer"}}}]}
    strict = jsonschema.Draft202012Validator(strict_json_schema(schema))
    assert strict.is_valid({"kind": "a", "x": 1}) and strict.is_valid({"kind": "b", "y": 2})
    assert not strict.is_valid({"kind": "a", "z": 1})


def test_explicit_additional_properties_stay():
    schema = {"type": "object", "properties": {"tags": {"type": "object", "additionalProperties": {"type": "integer"}},
                                               "free": {"type": "object", "additionalProperties": True}}}
    strict = jsonschema.Draft202012Validator(strict_json_schema(schema))
    assert strict.is_valid({"tags": {"x": 1}, "free": {"y": [1]}}) and not strict.is_valid({"tags": {}, "z": 1})
