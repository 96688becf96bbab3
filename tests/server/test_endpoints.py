"""GET /v1/models, /health, /metrics, /version; POST /tokenize and /detokenize."""

from __future__ import annotations

import json

from tests.server.conftest import MODEL_NAME, http


def test_models(client):
    [model] = client.models.list().data
    assert model.id == MODEL_NAME and model.object == "model" and isinstance(model.created, int)
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_tokenize_and_detokenize_round_trip(server, async_engine):
    tokenizer = async_engine.tokenizer
    status, _, raw = http(server, "POST", "/tokenize", {"prompt": "hello world", "model": MODEL_NAME})
    body = json.loads(raw)
    assert status == 200 and body["tokens"] == tokenizer.encode("hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    plain = json.loads(http(server, "POST", "/tokenize", {"prompt": "hello world",
                                                           "add_special_tokens": False})[2])["tokens"]
    assert plain == tokenizer.encode("hello world", add_special_tokens=False)
    status, _, raw = http(server, "POST", "/detokenize", {"tokens": plain})
    assert status == 200 and json.loads(raw)["prompt"] == "hello world"
    status, _, raw = http(server, "POST", "/detokenize", {"tokens": [10**7]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"


def test_tokenize_messages_counts_what_chat_prompts(server, client):
    messages = [{"role": "user", "content": "hello there"}]
    body = json.loads(http(server, "POST", "/tokenize", {"messages": messages})[2])
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert body["count"] == reply.usage.prompt_tokens


def test_health_and_version(server):
    status, _, raw = http(server, "GET", "/health")
    assert status == 200 and raw == b""
    status, _, raw = http(server, "GET", "/version")
    assert status == 200 and json.loads(raw)["version"]


def _sample(text: str, name: str) -> float:
    """The value of one sample line, e.g. ``pluginfer_generation_tokens_total``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_count_requests_tokens_and_latency(server, client):
    before = http(server, "GET", "/metrics")[2].decode()
    reply = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    http(server, "POST", "/v1/completions", {"prompt": "x", "seed": 2**64})
    status, headers, raw = http(server, "GET", "/metrics")
    after = raw.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert _sample(after, "pluginfer_generation_tokens_total") - _sample(before, "pluginfer_generation_tokens_total") == 4
    assert _sample(after, "pluginfer_prompt_tokens_total") > _sample(before, "pluginfer_prompt_tokens_total")
    assert 'pluginfer_requests_total{route="/v1/completions",status="200"}' in after
    assert 'pluginfer_requests_total{route="/v1/completions",status="400"}' in after
    assert _sample(after, "pluginfer_time_to_first_token_seconds_count") > 0
    # a sample per generated token after the first, however the outputs arrived (one by one or coalesced)
    assert (_sample(after, "pluginfer_inter_token_latency_seconds_count")
            - _sample(before, "pluginfer_inter_token_latency_seconds_count")) == 3
    for gauge in ("pluginfer_num_requests_running", "pluginfer_num_requests_waiting",
                  "pluginfer_kv_cache_usage_ratio"):
        assert f"\n{gauge} " in after
    queried = _sample(after, "pluginfer_prefix_cache_queries_total") - _sample(before, "pluginfer_prefix_cache_queries_total")
    assert queried == reply.usage.prompt_tokens  # the engine's counter, through the client's EngineStats
    assert "\npluginfer_num_preemptions_total " in after and "\npluginfer_prefix_cache_hits_total " in after


def test_developer_messages_are_system_messages(server):
    def count(role: str) -> list[int]:
        body = {"messages": [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]}
        return json.loads(http(server, "POST", "/tokenize", body)[2])["tokens"]

    assert count("developer") == count("system")
