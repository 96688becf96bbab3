"""``tool_choice: auto`` on what real models write: tagged calls, bare JSON naming a declared tool (with
``arguments`` or Llama 3's ``parameters``), JSON lists of parallel calls, Mistral's ``[TOOL_CALLS]``, with text
before them, or fenced as the whole answer; and what is not a call (JSON naming no declared tool, calls shown in
a Markdown code fence within other text, a call inside ``<think>`` reasoning). Each output is read whole and streamed in random cuts (one character at a time
too): the content, reasoning and calls are the same. Then through the ``openai`` client against a served model
whose output a grammar forces.

The outputs are as recorded from each family (model cards, chat templates, and reports of what the served model
answered: the Qwen2.5-Coder lines are its answers to a ``get_weather`` request under ``--tool-call-parser hermes``,
plain JSON with no ``<tool_call>`` tags, as vLLM issue 32926 tabulates for Qwen2.5-Coder-7B-Instruct).
"""

from __future__ import annotations

import json
import random

import pytest

from pluginfer.core.registry import get_registry
from pluginfer.server.chat import ChoiceText
from pluginfer.server.tools import Tool, ToolCalling
from tests.server.conftest import MODEL_NAME, TOOL_TEMPLATE, make_client
from tests.server.test_tools import TOOLS as SERVED_TOOLS
from tests.server.test_tools import _streamed_calls

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
         for name in ("get_weather", "get_time", "search", "Bash")]
PARIS = '{"city": "Paris"}'

# (parser, reasoning parser, model output, expected content, expected reasoning, expected [(name, arguments)])
CASES = [
    # Qwen2.5-Coder-0.5B-Instruct under hermes, the answer: bare JSON, no tags
    ("hermes", None, '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", None, [("get_weather", PARIS)]),
    # Qwen2.5-Coder-14B: pretty-printed, after a newline
    ("hermes", None, '\n{\n  "name": "Bash",\n  "arguments": {\n    "command": "ls /tmp",\n    "description": '
                     '"List files in /tmp directory"\n  }\n}', "", None,
     [("Bash", '{"command": "ls /tmp", "description": "List files in /tmp directory"}')]),
    # qwen2.5-coder:14b through Ollama: non-ASCII arguments kept as written
    ("hermes", None, '{"name": "search", "arguments": {"query": "北京今天的天气"}}', "", None,
     [("search", '{"query": "北京今天的天气"}')]),
    # Qwen2.5-Coder: leading text, then a JSON list of parallel calls
    ("hermes", None, 'I will check both.\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                     '{"name": "get_time", "arguments": {"zone": "cet"}}]', "I will check both.\n", None,
     [("get_weather", PARIS), ("get_time", '{"zone": "cet"}')]),
    # Qwen2.5-7B-Instruct: tagged (hermes), two calls
    ("hermes", None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>', "", None,
     [("get_weather", PARIS), ("get_time", '{"zone": "utc"}')]),
    # Qwen2.5-Coder-7B-Instruct: the call as the whole answer, fenced (as vLLM issue 32926 finds it most often)
    ("hermes", None, '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', "", None,
     [("get_weather", PARIS)]),
    ("hermes", None, '\n```\n[{"name": "get_time", "arguments": {}}]\n```\n', "", None, [("get_time", "{}")]),
    # Llama 3.1 8B Instruct (JSON tool calling, model card): "parameters", also under hermes
    ("hermes", None, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", None, [("get_weather", PARIS)]),
    ("llama3_json", None, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", None,
     [("get_weather", PARIS)]),
    # Llama 3.3 70B Instruct: several calls joined by "; ", read alike under hermes
    ("hermes", None, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": '
                     '{"zone": "cet"}};', "", None, [("get_weather", PARIS), ("get_time", '{"zone": "cet"}')]),
    # Llama 3.2 3B Instruct: a "type" key first, after some words
    ("llama3_json", None, 'Let me look that up. {"type": "function", "name": "get_weather", "parameters": '
                          '{"city": "Paris"}}', "Let me look that up. ", None, [("get_weather", PARIS)]),
    # Mistral 7B Instruct v0.3 (tokenizer v3)
    ("mistral", None, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
                      '"arguments": {}}]', "", None, [("get_weather", PARIS), ("get_time", "{}")]),
    # not calls: JSON naming no declared tool, a call shown in a code fence (JSON and tags), plain code
    ("hermes", None, '{"name": "get_stock", "arguments": {"ticker": "NVDA"}}',
     '{"name": "get_stock", "arguments": {"ticker": "NVDA"}}', None, []),
    ("hermes", None, 'Call it like this:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'
                     'and I will run it.', 'Call it like this:\n```json\n{"name": "get_weather", "arguments": '
                                           '{"city": "Paris"}}\n```\nand I will run it.', None, []),
    ("hermes", None, 'Qwen writes:\n```\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n```',
     'Qwen writes:\n```\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n```', None, []),
    ("hermes", None, "def f(x) { return {x: [1, 2]}; }", "def f(x) { return {x: [1, 2]}; }", None, []),
    ("hermes", None, 'The answer is {"city": "Paris"}.', 'The answer is {"city": "Paris"}.', None, []),
    # Qwen3 with a reasoning parser: the call it considers in <think> is reasoning; the one after, a call
    ("hermes", "qwen3", '<think>\nI could write <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> or '
                        '{"name": "get_time", "arguments": {}}; the weather first.\n</think>\n\n<tool_call>\n'
                        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     '\nI could write <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> or {"name": "get_time", '
     '"arguments": {}}; the weather first.\n', [("get_weather", PARIS)]),
    ("hermes", "qwen3", '<think>\n{"name": "get_time", "arguments": {}}\n</think>\n\nIt is noon.', "\n\nIt is noon.",
     '\n{"name": "get_time", "arguments": {}}\n', []),
]


def _choice(parser: str, reasoning: str | None) -> ChoiceText:
    registry = get_registry()
    calling = ToolCalling.from_request(TOOLS, "auto", None, registry.load("tool_parser", parser))
    return ChoiceText(registry.load("reasoning_parser", reasoning) if reasoning else None, calling)


def _whole(parser: str, reasoning: str | None, text: str) -> tuple[str, str | None, list[tuple[str, str]]]:
    message = _choice(parser, reasoning).message(text)
    calls = [(call["function"]["name"], call["function"]["arguments"]) for call in message.get("tool_calls", [])]
    return message["content"] or "", message.get("reasoning_content"), calls


def _streamed(parser: str, reasoning: str | None, text: str, cuts: list[int]):
    """What a client puts together from the deltas of ``text`` arriving cut at ``cuts``, then finished."""
    choice = _choice(parser, reasoning)
    content, thought, calls = "", "", {}
    for end, final in [*((cut, False) for cut in cuts), (len(text), True)]:
        delta = choice.delta(text[:end], final=final)
        content += delta.get("content", "")
        thought += delta.get("reasoning_content", "")
        for piece in delta.get("tool_calls", []):
            entry = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
            entry["name"] += piece["function"].get("name") or ""
            entry["arguments"] += piece["function"].get("arguments") or ""
    return content, thought or None, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


@pytest.mark.parametrize(("parser", "reasoning", "text", "content", "thought", "calls"), CASES)
def test_output_reads_the_same_whole_and_streamed(parser, reasoning, text, content, thought, calls):
    assert _whole(parser, reasoning, text) == (content, thought, calls)
    for arguments in (json.loads(arguments) for _, arguments in calls):
        assert isinstance(arguments, dict)
    rng = random.Random(len(text))
    every = list(range(1, len(text)))
    for cuts in [every, *(sorted(rng.sample(every, k)) for k in (1, 3, len(every) // 4, len(every) // 2))]:
        assert _streamed(parser, reasoning, text, cuts) == (content, thought, calls), cuts


SERVED = [  # (forced output, content, [(name, arguments)]) through the openai client, tools of test_tools.TOOLS
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('Both:\n[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}, {"name": "get_time", '
     '"arguments": {"zone": "cet"}}]', "Both:\n",
     [("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": "cet"})]),
    ('```json\n{"name": "get_time", "arguments": {"zone": "utc"}}\n```', None, [("get_time", {"zone": "utc"})]),
    ('Like this:\n```json\n{"name": "get_time", "arguments": {"zone": "utc"}}\n```',
     'Like this:\n```json\n{"name": "get_time", "arguments": {"zone": "utc"}}\n```', []),
    ('{"name": "get_stock", "arguments": {}}', '{"name": "get_stock", "arguments": {}}', []),
]


@pytest.fixture(scope="module")
def hermes_client(async_engine, make_server):
    """A hermes server over the shared engine, whose tokenizer renders tools (test_tools' template) meanwhile."""
    tokenizer = async_engine.tokenizer
    plain, tokenizer.chat_template = tokenizer.chat_template, TOOL_TEMPLATE
    with make_client(make_server(**{"server.tool_call_parser": "hermes"})) as client:
        yield client
    tokenizer.chat_template = plain


@pytest.mark.parametrize(("text", "content", "calls"), SERVED)
def test_served_calls_through_the_openai_client(hermes_client, text, content, calls):
    """The output forced by a grammar (random weights never write it): ``message.tool_calls`` and streamed
    ``delta.tool_calls`` carry the calls, the content the rest, and finish_reason says which."""
    request = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "weather in Paris?"}], tools=SERVED_TOOLS,
                   max_tokens=200, temperature=0, extra_body={"structured_outputs": {"choice": [text]}})
    reason = "tool_calls" if calls else "stop"
    [choice] = hermes_client.chat.completions.create(**request).choices
    assert choice.finish_reason == reason and choice.message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == calls
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls or [])
    streamed, pieces, reasons = _streamed_calls(hermes_client.chat.completions.create(**request, stream=True))
    assert streamed == (content or "") and reasons == [reason]
    assert [(c["name"], json.loads(c["arguments"])) for c in pieces.values()] == calls


@pytest.mark.parametrize("text", [
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\nThat is the call.',
    '```python\nprint({"name": "get_time"})\n```', "```", "``", '```json\n{"name": "get_weather"', "```js",
    '```json\n{"name": "get_weather", "arguments": {}}\n``',
])
def test_fenced_text_that_is_not_one_whole_call_is_content(text):
    """A fence with more after it, code, or a fence cut short: content, whole and streamed."""
    assert _whole("hermes", None, text) == (text, None, [])
    assert _streamed("hermes", None, text, list(range(1, len(text)))) == (text, None, [])


def test_parallel_tool_calls_false_keeps_the_first_of_a_list():
    registry = get_registry()
    calling = ToolCalling.from_request(TOOLS, "auto", False, registry.load("tool_parser", "hermes"))
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    message = ChoiceText(None, calling).message(text)
    assert message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", PARIS)]
