"""response_format and structured_outputs through the official openai client: the output parses and
validates on the tiny random llama (constrained decoding does not depend on the weights)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pydantic
import pytest

from tests.server.conftest import MODEL_NAME, http, make_async_client

MESSAGES = [{"role": "user", "content": "describe a pet as JSON"}]
# Small enough that even a model maxing out every whitespace slot closes it within the tiny context.
PET = {"type": "object",
       "properties": {"name": {"type": "string", "maxLength": 6}, "legs": {"type": "integer", "minimum": 0,
                                                                          "maximum": 8}},
       "required": ["name", "legs"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=6)
    kind: str = pydantic.Field(pattern="^(cat|dog)$")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client, temperature):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200, n=2, seed=5,
                                              temperature=temperature, response_format=JSON_SCHEMA)
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PET)


def test_streamed_json_equals_the_whole_answer(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=0,
                                           response_format=JSON_SCHEMA)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200,
                                                 temperature=0, response_format=JSON_SCHEMA, stream=True))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == whole.choices[0].message.content and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PET)


def test_parse_with_a_pydantic_model(client):
    """The SDK's own helper: it sends a strict json_schema built from the model and parses the answer."""
    completion = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, max_tokens=200,
                                               temperature=0, response_format=Pet)
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def test_json_object_is_an_object(server):
    async def main() -> list[tuple[str, str]]:
        async with make_async_client(server) as client:
            response = await client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=230, temperature=1.0, seed=11, n=3,
                response_format={"type": "json_object"})
            return [(choice.finish_reason, choice.message.content) for choice in response.choices]

    answers = asyncio.run(main())
    for finish_reason, content in answers:
        assert content.startswith("{")
        # Any object is unbounded, so on random weights only a finished one must parse.
        if finish_reason == "stop":
            assert isinstance(json.loads(content), dict)
    assert any(finish_reason == "stop" for finish_reason, _ in answers)


@pytest.mark.parametrize(("structured", "check"), [
    ({"choice": ["alpha", "beta gamma"]}, lambda text: text in ("alpha", "beta gamma")),
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    ({"grammar": 'start: "say " ("yes" | "no")'}, lambda text: text in ("say yes", "say no")),
    ({"json": PET}, lambda text: jsonschema.validate(json.loads(text), PET) is None),
    ({"json": json.dumps(PET), "disable_any_whitespace": True},
     lambda text: " " not in text.replace(json.loads(text)["name"], "")),
])
def test_structured_outputs_on_both_endpoints(client, structured, check):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=0,
                                          extra_body={"structured_outputs": structured})
    completion = client.completions.create(model=MODEL_NAME, prompt="answer:", max_tokens=200, temperature=0,
                                           extra_body={"structured_outputs": structured})
    for text, reason in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                         (completion.choices[0].text, completion.choices[0].finish_reason)):
        assert reason == "stop" and check(text), text


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format", "missing"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", "json_schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "nowhere"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "Extra"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
    ({"guided_json": PET}, "guided_json", "structured_outputs"),
])
def test_grammars_that_cannot_be_served_are_400(server, fields, param, says):
    status, _, raw = http(server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **fields})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and says in error["message"], error


def test_regex_classes_are_ascii(client):
    r"""``\d``, ``\w``, ``\s`` as OpenAI documents them (ECMAScript's: ASCII); random weights try every other digit,
    letter and space the tokenizer can spell (``tests/engine/test_regex_ascii.py`` checks the grammar itself)."""
    regex = r"\d{4}\s\w{4}\S{2}"
    pattern = {"type": "object", "required": ["id"], "additionalProperties": False,
               "properties": {"id": {"type": "string", "pattern": "^" + regex + "$"}}}
    for fields in ({"structured_outputs": {"regex": regex}},
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "id", "schema": pattern}}}):
        response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=1.0,
                                                  seed=9, n=6, extra_body=fields)
        for choice in response.choices:
            text = choice.message.content
            found = text if "structured_outputs" in fields else json.loads(text)["id"]
            assert choice.finish_reason == "stop" and re.fullmatch(regex, found, re.ASCII), text
