"""No silent ignore: every field of OpenAI's request schemas is honoured (a test says so) or a 400 naming it.

The field lists come from OpenAI's published spec (``shared/data/openai-openapi.json`` beside the
checkout), walked through ``$ref`` and ``allOf``; a copy of the lists is kept in
``data/openai_request_fields.json`` so the test runs without the 3 MB spec, and is checked
against the spec when it is there.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from pluginfer.server.protocol import ChatCompletionRequest, CompletionRequest
from pluginfer.server.unsupported import INFORMATIONAL
from tests.server.conftest import http

SPEC = Path(__file__).resolve().parents[3] / "shared" / "data" / "openai-openapi.json"
FIELDS_COPY = Path(__file__).with_name("data") / "openai_request_fields.json"
SCHEMAS = {"CreateChatCompletionRequest": ("/v1/chat/completions", ChatCompletionRequest),
           "CreateCompletionRequest": ("/v1/completions", CompletionRequest)}
BASE = {"CreateChatCompletionRequest": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "CreateCompletionRequest": {"prompt": "hi", "max_tokens": 1}}

# Honoured fields and the test that shows each one doing what OpenAI says it does.
HONOURED = {
    "messages": "tests/server/test_chat.py::test_chat_completion_has_the_openai_shape",
    "model": "tests/server/test_chat.py::test_model_is_optional_and_text_parts_equal_a_string",
    "prompt": "tests/server/test_completions.py::test_prompt_forms_agree",
    "max_tokens": "tests/server/test_chat.py::test_chat_completion_has_the_openai_shape",
    "max_completion_tokens": "tests/server/test_chat.py::test_model_is_optional_and_text_parts_equal_a_string",
    "temperature": "tests/engine/test_sampler.py::test_sampling_frequencies_follow_softmax_with_temperature",
    "top_p": "tests/engine/test_sampler.py::test_top_p_keeps_smallest_set_reaching_p",
    "seed": "tests/server/test_chat.py::test_n_choices_each_finish_once",
    "n": "tests/server/test_chat.py::test_n_choices_each_finish_once",
    "frequency_penalty": "tests/engine/test_sampler.py::test_frequency_and_presence_penalties_match_openai_definition",
    "presence_penalty": "tests/engine/test_sampler.py::test_frequency_and_presence_penalties_match_openai_definition",
    "logit_bias": "tests/engine/test_sampler.py::test_logit_bias_is_added_to_its_row_only",
    "logprobs": "tests/server/test_chat.py::test_logprobs_count_tokens_and_alternatives",
    "top_logprobs": "tests/server/test_chat.py::test_logprobs_count_tokens_and_alternatives",
    "stop": "tests/server/test_chat.py::test_stop_strings_cut_the_text",
    "stream": "tests/server/test_chat.py::test_streamed_text_equals_the_greedy_answer",
    "stream_options": "tests/server/test_chat.py::test_continuous_usage_counts_up",
    "echo": "tests/server/test_completions.py::test_echo_prepends_the_prompt",
    "suffix": "tests/server/test_fill_in_the_middle.py::test_middle_is_transformers_greedy_continuation",
    "best_of": "tests/server/test_request_fields.py::test_best_of_equal_to_n_is_served",
    "reasoning_effort": "tests/server/test_request_fields.py::test_reasoning_effort_goes_to_templates_that_read_it",
    "response_format": "tests/server/test_structured_output.py::test_json_schema_output_validates",
    "tools": "tests/server/test_tools.py::test_named_function_is_called_with_valid_arguments",
    "tool_choice": "tests/server/test_tools.py::test_required_calls_validate_against_their_tools",
    "parallel_tool_calls": "tests/server/test_tools.py::test_required_calls_validate_against_their_tools",
}

# A value OpenAI's spec allows that this server refuses, for each field it cannot (fully) honour.
REFUSED_EXAMPLES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "prediction": {"type": "content", "content": "x"},
    "moderation": {"model": "omni-moderation-latest"},
    "verbosity": "low",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "store": True,
    "service_tier": "flex",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"},
    "tool_choice": "required",  # without tools
    "suffix": "and then",  # the tiny llama's tokenizer has no fill-in-the-middle tokens
    "best_of": 2,
}


def spec_fields(spec: dict[str, Any], name: str) -> list[str]:
    """Top-level property names of a schema, through $ref and allOf."""
    schemas = spec["components"]["schemas"]

    def resolve(schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def walk(schema: dict[str, Any]) -> dict[str, Any]:
        schema = resolve(schema)
        found: dict[str, Any] = {}
        for part in schema.get("allOf", []):
            found.update(walk(part))
        found.update(schema.get("properties", {}))
        return found

    return sorted(walk(schemas[name]))


def load_fields() -> dict[str, list[str]]:
    return json.loads(FIELDS_COPY.read_text())


@pytest.mark.skipif(not SPEC.is_file(), reason=f"{SPEC} is not beside this checkout")
def test_the_copied_field_lists_match_the_spec():
    spec = json.loads(SPEC.read_text())
    assert load_fields() == {name: spec_fields(spec, name) for name in SCHEMAS}, (
        f"OpenAI's spec changed: rewrite {FIELDS_COPY} from it and classify the new fields")


def _covering_test_exists(node: str) -> bool:
    path, function = node.split("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return callable(getattr(module, function, None))


@pytest.mark.parametrize("schema", SCHEMAS)
def test_every_spec_field_is_honoured_or_refused(server, schema):
    path, model = SCHEMAS[schema]
    unclassified = []
    for field in load_fields()[schema]:
        rule = model.UNSUPPORTED.get(field)
        if field in REFUSED_EXAMPLES and (rule is not None or field in model.model_fields):
            status, _, raw = http(server, "POST", path, {**BASE[schema], field: REFUSED_EXAMPLES[field]})
            error = json.loads(raw).get("error") or {}
            assert status == 400 and error.get("param") == field, (field, status, raw)
        if rule is not None:  # the values that ask for nothing are served
            for value in rule.accepted:
                status, _, raw = http(server, "POST", path, {**BASE[schema], field: value})
                assert status == 200, (field, value, raw)
        elif field in INFORMATIONAL:
            value = {"metadata": {"k": "v"}}.get(field, "someone")
            status, _, raw = http(server, "POST", path, {**BASE[schema], field: value})
            assert status == 200, (field, raw)
        elif field in model.model_fields and field in HONOURED:
            assert _covering_test_exists(HONOURED[field]), (field, HONOURED[field])
        else:
            unclassified.append(field)
    assert not unclassified, f"{schema}: fields neither honoured (with a test) nor refused: {unclassified}"


@pytest.mark.parametrize(("path", "base"), [("/v1/chat/completions", BASE["CreateChatCompletionRequest"]),
                                            ("/v1/completions", BASE["CreateCompletionRequest"])])
@pytest.mark.parametrize(("field", "value"), [("no_such_field", 1), ("length_penalty", 2.0),
                                              ("guided_decoding_backend", "x")])
def test_unknown_and_unsupported_extra_fields_are_400(server, path, base, field, value):
    status, _, raw = http(server, "POST", path, {**base, field: value})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == field and field in error["message"]


def test_use_beam_search_false_is_served(server):
    status, _, raw = http(server, "POST", "/v1/completions", {**BASE["CreateCompletionRequest"],
                                                              "use_beam_search": False})
    assert status == 200, raw


def test_best_of_equal_to_n_is_served(server):
    status, _, raw = http(server, "POST", "/v1/completions", {**BASE["CreateCompletionRequest"],
                                                              "n": 2, "best_of": 2})
    assert status == 200 and len(json.loads(raw)["choices"]) == 2


def test_stream_obfuscation_is_refused_naming_the_nested_field(server):
    body = {**BASE["CreateChatCompletionRequest"], "stream": True,
            "stream_options": {"include_obfuscation": True}}
    status, _, raw = http(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == "stream_options.include_obfuscation"


def test_reasoning_effort_goes_to_templates_that_read_it(server, async_engine):
    body = {**BASE["CreateChatCompletionRequest"], "reasoning_effort": "low"}
    status, _, raw = http(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == "reasoning_effort"  # the tiny template
    tokenizer = async_engine.tokenizer
    plain = tokenizer.chat_template
    tokenizer.chat_template = plain + "{{- 'effort=' + reasoning_effort if reasoning_effort is defined }}"
    try:
        status, _, raw = http(server, "POST", "/tokenize", {"messages": body["messages"]})
        without = json.loads(raw)["count"]
        status, _, raw = http(server, "POST", "/v1/chat/completions", body)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens"] > without  # 'effort=low' was rendered
    finally:
        tokenizer.chat_template = plain
