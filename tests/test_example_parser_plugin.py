"""The worked out-of-tree parser plugin (plugins/pluginfer-example-parser): discovered, conformant to the
parser kit, and serving its made-up "memo" chat format to the official openai client."""

from __future__ import annotations

import importlib.metadata
import json

import openai
import pytest

from pluginfer.core.registry import Registry
from pluginfer.testing.endpoint_contract import serve
from pluginfer.testing.parser_contract import check_reasoning_parser, check_tool_parser

try:
    importlib.metadata.distribution("pluginfer-example-parser")
except importlib.metadata.PackageNotFoundError:  # the README test command installs it
    pytest.skip("plugins/pluginfer-example-parser is not installed (pip install -e ./plugins/pluginfer-example-parser)",
                allow_module_level=True)

from pluginfer_example_parser.parsers import MemoReasoningParser  # noqa: E402 - after the installed check

# A template that renders tools (the tiny llama's own renders none), in the memo format's words.
MEMO_TEMPLATE = (
    "{%- if tools %}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n{% endif %}"
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{%- if add_generation_prompt %}assistant: ~~{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
MEMO_TEXT = 'Let me check. <<call get_weather {"city": "Paris"}>><<call get_time {}>>'
SETTINGS = {"dtype": "float32", "cache.num_blocks": 64, "cache.block_size": 8}


def test_the_installed_plugin_is_discovered_and_listed() -> None:
    registry = Registry.discover()
    info = next(p for p in registry.plugins if p.distribution == "pluginfer-example-parser")
    assert info.error is None and info.version == "0.1.0"
    assert registry.resolve("tool_parser", "memo").factory == "pluginfer_example_parser.parsers:MemoToolParser"
    listing = registry.describe()
    assert "tool_parser memo: <<call NAME {json}>> tool calls of the memo chat format - usable" in listing
    assert "reasoning_parser memo: reasoning until ~~ in the memo chat format - usable" in listing


def test_the_parsers_pass_the_conformance_kit() -> None:
    registry = Registry.discover()
    check_tool_parser(registry.load("tool_parser", "memo"), [
        (MEMO_TEXT, "Let me check. ", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("no call here", "no call here", []),
        ("half <<call get_weather {oops}>>", "half <<call get_weather {oops}>>", []),
    ], markers=("<<call ", ">>"))
    check_reasoning_parser(registry.load("reasoning_parser", "memo"), [
        ("the user wants weather ~~ Sunny.", "the user wants weather", "Sunny."),
        ("~~ opened by the model ~~ Sunny.", "opened by the model", "Sunny."),
        ("~~ ~~ no reasoning", "", "no reasoning"),
        ("cut short", "cut short", ""),
    ], markers=("~~",))


@pytest.fixture(scope="module")
def servers(tiny_llama_checkpoint):
    """(memo server, plain server), each over its own engine of the tiny llama."""
    model = str(tiny_llama_checkpoint[0])
    with serve(model, **SETTINGS, **{"server.tool_call_parser": "memo", "server.reasoning_parser": "memo"}) as memo, \
            serve(model, **SETTINGS) as plain:
        for server in (memo, plain):  # the same prompt on both
            server.engine.tokenizer.chat_template = MEMO_TEMPLATE
        yield memo, plain


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_tool_calls_in_the_memo_format_reach_the_openai_client(servers) -> None:
    """The output is forced to the memo format by a grammar, since random weights never write it."""
    memo, _ = servers
    request = dict(model=memo.config.model, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
                   extra_body={"structured_outputs": {"choice": [MEMO_TEXT]}})
    with client(memo) as openai_client:
        [choice] = openai_client.chat.completions.create(**request).choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check. "
        calls = choice.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [("get_weather", {"city": "Paris"}), ("get_time", {})]
        assert all(c.id.startswith("call_memo_") for c in calls) and calls[0].id != calls[1].id
        content, streamed = "", {}
        for chunk in openai_client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for piece in choice.delta.tool_calls or []:
                    streamed.setdefault(piece.index, [piece.function.name, ""])[1] += piece.function.arguments or ""
        assert content == "Let me check. "
        assert [(name, json.loads(arguments)) for name, arguments in streamed.values()] == \
            [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_the_reasoning_parser_splits_what_the_model_wrote(servers) -> None:
    """The same greedy request on a server without the parser gives the text; the memo server answers the
    plugin's split of it, whole and streamed (noise never writes ~~, so all of it is reasoning)."""
    memo, plain = servers
    request = dict(messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    with client(plain) as plain_client, client(memo) as memo_client:
        text = plain_client.chat.completions.create(model=plain.config.model, **request).choices[0].message.content
        expected = MemoReasoningParser().split(text, final=True)
        assert expected[0] and "~~" not in text
        message = memo_client.chat.completions.create(model=memo.config.model, **request).choices[0].message
        assert ((message.model_extra or {}).get("reasoning_content") or "", message.content) == expected
        reasoning, content = "", ""
        for chunk in memo_client.chat.completions.create(model=memo.config.model, **request, stream=True):
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == expected
