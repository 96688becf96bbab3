"""POST /v1/chat/completions through the official openai client (strict response validation)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.conftest import MODEL_NAME, http, make_async_client, sse_events

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_chat_completion_has_the_openai_shape(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, **GREEDY)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert isinstance(response.created, int) and response.model == MODEL_NAME
    [choice] = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert choice.message.role == "assistant" and choice.message.content
    usage = response.usage
    assert usage.completion_tokens == 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_model_is_optional_and_text_parts_equal_a_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "hello\nworld"}]
    by_parts = client.chat.completions.create(model="", messages=parts, max_completion_tokens=5, **GREEDY)
    by_string = client.chat.completions.create(model=MODEL_NAME, messages=joined, max_tokens=5, **GREEDY)
    assert by_parts.choices[0].message.content == by_string.choices[0].message.content
    assert by_parts.usage.prompt_tokens == by_string.usage.prompt_tokens


def test_streamed_text_equals_the_greedy_answer(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(chunk.usage is None for chunk in content_chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in content_chunks)
    assert text == whole.choices[0].message.content
    reasons = [chunk.choices[0].finish_reason for chunk in content_chunks]
    assert reasons[-1] == "length" and reasons.count("length") == 1 and set(reasons[:-1]) == {None}


def test_continuous_usage_counts_up(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY)
    counts = [chunk.usage.completion_tokens for chunk in stream]
    assert counts == sorted(counts) and counts[-1] == 5


def test_n_choices_each_finish_once(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=3,
                                              temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == 12
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=3,
                                            temperature=1.0, seed=7, stream=True,
                                            extra_body={"ignore_eos": True})
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    texts = {0: "", 1: "", 2: ""}
    for chunk in stream:
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert texts == {c.index: c.message.content for c in response.choices}  # same seed, same samples


def test_logprobs_count_tokens_and_alternatives(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True,
                                              top_logprobs=3, **GREEDY)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert 1 <= len(entry.top_logprobs) <= 3
        assert entry.logprob <= 0 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True,
                                            stream=True, **GREEDY)
    streamed = [e for chunk in stream if chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # top_logprobs not asked for


def test_stop_strings_cut_the_text(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, **GREEDY)
    text = whole.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 2]
    forms = [{"stop": stop}, {"stop": [stop, "never-seen"]},
             {"extra_body": {"ignore_eos": True, "stop": {"Single": stop}}},
             {"extra_body": {"ignore_eos": True, "stop": {"Multiple": ["never-seen", stop]}}}]
    for form in forms:
        cut = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16,
                                             temperature=0.0, **{"extra_body": {"ignore_eos": True}, **form})
        assert cut.choices[0].finish_reason == "stop", form
        assert cut.choices[0].message.content == text[: text.index(stop)], form


def test_async_client_and_extra_fields(server):
    async def main() -> str:
        async with make_async_client(server) as client:
            response = await client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=3, user="someone", top_p=0.9, seed=1,
                presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": 1.0},
                extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2,
                            "stop_token_ids": [3], "skip_special_tokens": False,
                            "chat_template_kwargs": {"enable_thinking": False}})
            return response.choices[0].finish_reason

    assert asyncio.run(main()) in ("stop", "length")


def test_reasoning_content_is_split_off(make_server):
    server = make_server(**{"server.reasoning_parser": "deepseek_r1"})
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, _, raw = http(server, "POST", "/v1/chat/completions", body)
    assert status == 200
    message = json.loads(raw)["choices"][0]["message"]
    # Noise never closes </think>, so all of it is reasoning.
    assert message["content"] == "" and message["reasoning_content"]
    status, _, raw = http(server, "POST", "/v1/chat/completions", {**body, "stream": True})
    *chunks, done = sse_events(raw)
    assert done == "[DONE]"
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == ""
