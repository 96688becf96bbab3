"""The worked out-of-tree endpoint plugin (plugins/pluginfer-example-endpoint): discovered, conformant to the
endpoint kit, and served: its route answers what transformers' tokenizer and greedy generation say, its
request processor rewrites real requests of the official openai client."""

from __future__ import annotations

import importlib.metadata
import json
import urllib.error
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from pluginfer import SamplingParams
from pluginfer.core.registry import Registry
from pluginfer.core.serving import PromptRequest
from pluginfer.testing.endpoint_contract import check_endpoint, check_request_processor, serve
from tests.checkpoints import hf_greedy

try:
    importlib.metadata.distribution("pluginfer-example-endpoint")
except importlib.metadata.PackageNotFoundError:  # the README test command installs it
    pytest.skip("plugins/pluginfer-example-endpoint is not installed "
                "(pip install -e ./plugins/pluginfer-example-endpoint)", allow_module_level=True)

KEY = "sk-plugin-test"
SETTINGS = {"dtype": "float32", "cache.num_blocks": 64, "cache.block_size": 8, "server.api_keys": [KEY]}
MESSAGES = [{"role": "user", "content": "Tell me about Paris"}]


def post(server, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_installed_plugin_is_discovered_and_conformant() -> None:
    registry = Registry.discover()
    info = next(p for p in registry.plugins if p.distribution == "pluginfer-example-endpoint")
    assert info.error is None and info.hooks == ["pluginfer_endpoints", "pluginfer_request_processors"]
    listing = registry.describe()
    assert "endpoint echo-tokens: POST /v1/example/echo-tokens" in listing and "request_processor shout: " in listing
    assert check_endpoint(registry.load("endpoint", "echo-tokens")) == [("POST", "/v1/example/echo-tokens")]
    processor = registry.load("request_processor", "shout")(None)
    request = PromptRequest("chat", "r1", SamplingParams(max_tokens=100, min_tokens=20), messages=MESSAGES)
    after = check_request_processor(processor, request, ["", "a", "ab", "abc é"])
    assert (after.params.max_tokens, after.params.min_tokens, after.messages) == (16, 16, MESSAGES)


@pytest.fixture(scope="module", params=[False, True], ids=["thread", "engine-process"])
def servers(request, tiny_llama_checkpoint):
    """(plugin server, plain server) of the tiny llama, each over its own engine: in a thread, and in an engine
    core process of its own as `pluginfer serve` runs it (the context's engine is then an EngineClient)."""
    model = str(tiny_llama_checkpoint[0])
    plugins = {"server.endpoints": ["echo-tokens"], "server.request_processors": ["shout"]}
    with serve(model, request.param, **SETTINGS, **plugins) as plugged, serve(model, **SETTINGS) as plain:
        yield plugged, plain


def test_the_route_tokenizes_and_generates_as_transformers_does(servers, tiny_llama_checkpoint) -> None:
    plugged, plain = servers
    directory, model = tiny_llama_checkpoint
    text = "The quick brown fox jumps over the lazy dog"
    status, answer = post(plugged, "/v1/example/echo-tokens", {"text": text, "max_tokens": 8})
    assert status == 200, answer
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert (answer["tokens"], answer["count"]) == (tokens, len(tokens))
    assert answer["pieces"] == [tokenizer.decode([t]) for t in tokens]
    assert answer["continuation"]["token_ids"] == hf_greedy(model, tokens, 8)
    assert post(plugged, "/v1/example/echo-tokens", {"text": ""}) == (400, {"error": {
        "message": "text: give a non-empty string", "type": "invalid_request_error", "param": "text", "code": None}})
    assert post(plugged, "/v1/example/echo-tokens", {"text": text}, key=None)[0] == 401  # the API keys apply
    assert post(plain, "/v1/example/echo-tokens", {"text": text})[0] == 404  # only where the config names it


def test_the_request_processor_rewrites_real_requests(servers) -> None:
    plugged, plain = servers
    with openai.OpenAI(base_url=f"{plugged.url}/v1", api_key=KEY, max_retries=0) as shouting, \
            openai.OpenAI(base_url=f"{plain.url}/v1", api_key=KEY, max_retries=0) as quiet:
        common = dict(temperature=0, extra_body={"ignore_eos": True})
        expected = quiet.completions.create(model=plain.config.model, prompt="Paris is", max_tokens=16, **common)
        loud = shouting.completions.create(model=plugged.config.model, prompt="Paris is", max_tokens=40, **common)
        assert loud.usage.completion_tokens == 16  # capped by the processor's preprocess
        assert loud.choices[0].text == expected.choices[0].text.upper() != expected.choices[0].text
        streamed = shouting.completions.create(model=plugged.config.model, prompt="Paris is", max_tokens=40,
                                               stream=True, **common)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == loud.choices[0].text
        chat = dict(messages=MESSAGES, max_tokens=40, **common)
        quiet_chat = quiet.chat.completions.create(model=plain.config.model, **{**chat, "max_tokens": 16})
        loud_chat = shouting.chat.completions.create(model=plugged.config.model, **chat)
        assert loud_chat.choices[0].message.content == quiet_chat.choices[0].message.content.upper()
        with pytest.raises(openai.BadRequestError) as refused:
            shouting.chat.completions.create(model=plugged.config.model, max_tokens=4,
                                             messages=[{"role": "user", "content": "say <blocked>"}])
        error = refused.value.body
        assert error["message"] == "request processor 'shout': the prompt holds <blocked>, which this server refuses"
        assert (error["param"], error["code"]) == ("messages", "request_processor_error")
