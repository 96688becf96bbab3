"""``tool_choice: auto`` with the hermes parser: free text, and a call held to a declared tool once it starts.

Random weights never spell ``<tool_call>`` out of eight byte-level pieces, so this module's checkpoint has
``<tool_call>`` and ``</tool_call>`` as added (not special) tokens, as Qwen2.5's tokenizer has them, and the
requests raise the opening token's logit so that the model starts calls on its own. Once it does, random
weights try every key and value the grammar lets them; the oracle is ``jsonschema`` on each tool's schema
with ``additionalProperties: false`` written into every object (the schemas are sent without it, as
LangChain sends them).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from langchain_core.utils.function_calling import convert_to_openai_tool
from transformers import AutoTokenizer

from pluginfer.server.launch import BackgroundServer
from tests.checkpoints import save_hf_model
from tests.conftest import TINY_LLAMA
from tests.engine.test_strict_schema import Forecast, closed, get_weather
from tests.server.conftest import MODEL_NAME, TOOL_TEMPLATE, make_client, server_config, start_engine
from tests.server.test_tools import _streamed_calls

TOOLS = [convert_to_openai_tool(get_weather), convert_to_openai_tool(Forecast)]
SCHEMAS = {tool["function"]["name"]: closed(tool["function"]["parameters"]) for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]
SEEDS = [1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer_dir = tmp_path_factory.mktemp("hermes_tokenizer")
    tokenizer.save_pretrained(str(tokenizer_dir))
    out = tmp_path_factory.mktemp("hermes_llama")
    save_hf_model("LlamaForCausalLM", TINY_LLAMA, out, tokenizer_dir)
    return out, tokenizer


@pytest.fixture(scope="module")
def hermes_engine(checkpoint):
    engine = start_engine(server_config(checkpoint[0]))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def make_hermes_server(checkpoint, hermes_engine):
    servers: list[BackgroundServer] = []

    def make(**overrides) -> BackgroundServer:
        servers.append(BackgroundServer(hermes_engine, server_config(
            checkpoint[0], **{"server.tool_call_parser": "hermes", **overrides})))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def hermes_server(make_hermes_server) -> BackgroundServer:
    return make_hermes_server()


@pytest.fixture(scope="module")
def auto_client(hermes_server):
    with make_client(hermes_server) as client:
        yield client


@pytest.fixture(scope="module")
def call_token(checkpoint) -> str:
    [token] = checkpoint[1].encode("<tool_call>", add_special_tokens=False)
    return str(token)


def _request(seed: int, bias: dict[str, float], **fields) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 160, "temperature": 1.0,
            "seed": seed, "logit_bias": bias, **fields}


@pytest.mark.parametrize("seed", SEEDS)
def test_auto_calls_hold_only_declared_keys(auto_client, call_token, seed):
    """Every call the model starts is a declared tool with arguments that validate, whole and streamed."""
    request = _request(seed, {call_token: 6.0})
    response = auto_client.chat.completions.create(**request, n=2)
    for choice in response.choices:
        calls = choice.message.tool_calls or []
        assert calls, choice.message.content  # the raised logit makes it call before the context runs out
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert "<tool_call>" not in (choice.message.content or "")
        assert choice.finish_reason in ("tool_calls", "length")  # "length": text after the calls ran on
    whole = auto_client.chat.completions.create(**request)
    content, calls, reasons = _streamed_calls(auto_client.chat.completions.create(**request, stream=True))
    message = whole.choices[0].message
    assert content == (message.content or "") and reasons == [whole.choices[0].finish_reason]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments) for call in message.tool_calls or []]
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_plain_text_answers_come_back_as_content(auto_client, call_token, seed):
    """With no call started the grammar holds the text to nothing more than free text does: the same text as
    the same request under a grammar of any text (which then takes the grammar's place: the parser reads)."""
    bias = {call_token: -100.0}
    auto = auto_client.chat.completions.create(**_request(seed, bias, max_tokens=40))
    free = auto_client.chat.completions.create(**_request(seed, bias, max_tokens=40, extra_body={
        "structured_outputs": {"regex": "(.|\\n)*"}}))
    [choice] = auto.choices
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.message.content == free.choices[0].message.content
    assert choice.finish_reason == free.choices[0].finish_reason
    streamed, calls, reasons = _streamed_calls(
        auto_client.chat.completions.create(**_request(seed, bias, max_tokens=40), stream=True))
    assert streamed == choice.message.content and not calls and reasons == [choice.finish_reason]


def test_a_reasoning_parser_keeps_auto_unconstrained(make_hermes_server, call_token):
    """With a reasoning parser no grammar holds auto (it would forbid <think> from the first token): the
    reasoning is split off as without tools. deepseek_r1 reads an output without ``</think>`` as all reasoning."""
    with make_client(make_hermes_server(**{"server.reasoning_parser": "deepseek_r1"})) as client:
        answer = client.chat.completions.create(**_request(1, {call_token: -100.0}, max_tokens=30)).choices[0]
        plain = client.chat.completions.create(**_request(1, {call_token: -100.0}, max_tokens=30,
                                                          tool_choice="none")).choices[0]
    reasoning = answer.message.model_extra["reasoning_content"]
    assert reasoning and not answer.message.content and not answer.message.tool_calls
    assert reasoning == plain.message.model_extra["reasoning_content"]  # the same sampling: no grammar
