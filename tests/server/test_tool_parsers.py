"""Tool-call parsers on text as the real models write it; streamed splits add up to the whole at every cut."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pluginfer.core.registry import UnknownPluginError, get_registry
from pluginfer.engine.strict_schema import strict_json_schema
from pluginfer.engine.structured import (
    GrammarCompiler,
    StructuredOutputsParams,
    accept_token,
    fill_token_bitmask,
)
from pluginfer.server.tool_grammar import auto_tool_grammar, special_tokens
from pluginfer.server.tool_parsers import FunctionCall, get_tool_parser

WEATHER = '{"location": "San Francisco, CA, USA", "unit": "celsius"}'
DATE = '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}'

# (parser, model output, expected content, expected calls). Formats from each model's chat template
# and model card: Qwen2.5 / Hermes 2 Pro, Llama 3.1 (JSON tool calling), Mistral 7B v0.3 / Nemo
# (tokenizer v3) and Mistral Small 3.2 (v11), DeepSeek V3 and V3.1.
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_current_temperature", "arguments": {WEATHER}}}\n</tool_call>',
     "", [("get_current_temperature", WEATHER)]),
    ("hermes", f'Let me check both.\n<tool_call>\n{{"name": "get_current_temperature", "arguments": {WEATHER}}}\n'
               f'</tool_call>\n<tool_call>\n{{"name": "get_temperature_date", "arguments": {DATE}}}\n</tool_call>',
     "Let me check both.\n", [("get_current_temperature", WEATHER), ("get_temperature_date", DATE)]),
    ("hermes", "The weather in Paris is 18°C and sunny.", "The weather in Paris is 18°C and sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", "{}")]),  # no closing tag
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("qwen", '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>', "", [("search", '{"q": "x"}')]),
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                    '"unit": "Fahrenheit"}}', "",
     [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')]),
    ("llama3_json", '<|python_tag|>{"name": "search", "arguments": {"q": "llama"}}; {"name": "get_time", '
                    '"parameters": {}}', "", [("search", '{"q": "llama"}'), ("get_time", "{}")]),
    ("llama3_json", "Hello! How can I help?", "Hello! How can I help?", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_current_weather", "arguments": {WEATHER}}}]</s>', "",
     [("get_current_weather", WEATHER)]),
    ("mistral", f'[TOOL_CALLS]get_current_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{{}}</s>', "",
     [("get_current_weather", WEATHER), ("get_time", "{}")]),
    ("mistral", "Bonjour ! Il fait beau.</s>", "Bonjour ! Il fait beau.</s>", []),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"location": "Hangzhou"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "",
     [("get_weather", '{"location": "Hangzhou"}'), ("get_time", "{}")]),
    ("deepseek_v31", 'I will look it up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                     '{"location": "Hangzhou"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "I will look it up.", [("get_weather", '{"location": "Hangzhou"}')]),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_finished_output_splits_into_content_and_calls(name, text, content, calls):
    parsed = get_tool_parser(name).parse(text, final=True)
    assert parsed.content == content
    assert [(call.name, call.arguments) for call in parsed.calls] == calls
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streamed_splits_only_grow_and_end_at_the_whole(name, text, content, calls):
    parser = get_tool_parser(name)
    last_content, last_calls = "", []
    for cut in range(len(text) + 1):
        parsed = parser.parse(text[:cut], final=False)
        assert parsed.content.startswith(last_content), (cut, parsed.content, last_content)
        assert parsed.calls[:len(last_calls)] == last_calls, cut
        last_content, last_calls = parsed.content, parsed.calls
    final = parser.parse(text, final=True)
    assert final.content.startswith(last_content) and final.calls[:len(last_calls)] == last_calls
    assert final.content == content and [(c.name, c.arguments) for c in final.calls] == calls


def test_mistral_ids_are_nine_alphanumerics_others_are_call_ids():
    mistral = get_tool_parser("mistral").new_id()
    assert len(mistral) == 9 and mistral.isalnum()
    assert get_tool_parser("hermes").new_id().startswith("call_")


def test_registry_names_and_unknown_parser():
    names = {name for spec in get_registry().specs("tool_parser") for name in spec.names}
    assert {"hermes", "qwen", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31"} <= names
    with pytest.raises(UnknownPluginError, match="no tool_parser plugin named 'nope'; available: ") as raised:
        get_tool_parser("nope")
    listed = str(raised.value).split("available: ")[1].split(".")[0].split(", ")
    assert listed == sorted(names) and {"deepseek_v3", "hermes", "llama3_json", "mistral", "qwen"} <= set(listed)
    assert FunctionCall("f", "{}") == FunctionCall("f", "{}")


CALL_TOOLS = [("get_weather", strict_json_schema({"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}}})),
              ("get_time", strict_json_schema({"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}))]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "deepseek_v3"])
def test_each_call_syntax_reads_back_as_a_valid_call(tiny_tokenizer_dir, name):
    """Random logits sampled under the auto grammar of each built-in parser's call syntax: once the trigger is
    written (given as the first tokens), what follows is a call the parser reads back, of a declared tool,
    with arguments that validate (jsonschema), and every syntax of the parser is reached over the seeds."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    parser = get_tool_parser(name)
    grammar = StructuredOutputsParams(grammar=auto_tool_grammar(parser.call_syntax, CALL_TOOLS,
                                                                special_tokens(tokenizer)))
    begins = set()
    for seed in range(12):
        syntax = parser.call_syntax[seed % len(parser.call_syntax)]
        prompt = ("" if syntax.opens_output else "Let me check. ") + syntax.trigger
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        matcher = compiler.matcher(grammar)
        generator = torch.Generator().manual_seed(seed)
        for token in ids:
            assert matcher.consume_token(token), matcher.get_error()
        for _ in range(150):
            logits = torch.randn(len(tokenizer), generator=generator)
            logits[~fill_token_bitmask([matcher], len(tokenizer))[0]] = -float("inf")
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            if token == tokenizer.eos_token_id:
                break
            ids.append(token)
            if accept_token(matcher, token):
                break
        text = tokenizer.decode(ids)
        calls = parser.parse(text, final=True).calls
        assert calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), dict(CALL_TOOLS)[call.name])
        begins.add(next(s.begin for s in parser.call_syntax if text[len(prompt) - len(syntax.trigger):].startswith(
            s.begin.split("{name}")[0])))
    assert begins == {syntax.begin for syntax in parser.call_syntax}
