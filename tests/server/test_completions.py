"""POST /v1/completions: the four prompt forms, echo, logprobs, n, streaming (read leniently)."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL_NAME, http, sse_events

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_completion_has_the_openai_shape(client):
    response = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5, **GREEDY)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert isinstance(response.created, int) and response.model == MODEL_NAME
    [choice] = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert response.usage.completion_tokens == 5
    assert response.usage.total_tokens == response.usage.prompt_tokens + 5


def test_prompt_forms_agree(client, server):
    prompts = ["hello world", "the cat sat"]
    tokens = [json.loads(http(server, "POST", "/tokenize", {"prompt": p})[2])["tokens"] for p in prompts]
    by_text = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=tokens, max_tokens=4, **GREEDY)
    one_text = client.completions.create(model=MODEL_NAME, prompt=prompts[1], max_tokens=4, **GREEDY)
    one_ids = client.completions.create(model=MODEL_NAME, prompt=tokens[1], max_tokens=4, **GREEDY)
    texts = [choice.text for choice in by_text.choices]
    assert [choice.index for choice in by_text.choices] == [0, 1]
    assert [choice.text for choice in by_ids.choices] == texts
    assert one_text.choices[0].text == one_ids.choices[0].text == texts[1]
    assert by_text.usage.prompt_tokens == sum(len(t) for t in tokens)
    assert by_text.usage.completion_tokens == 8


def test_n_over_several_prompts_indexes_choices(client):
    response = client.completions.create(model=MODEL_NAME, prompt=["a b", "c d"], max_tokens=3, n=2,
                                         temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 12


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=4, **GREEDY)
    echoed = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=4, echo=True,
                                       **GREEDY)
    assert echoed.choices[0].text == "hello world" + plain.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_too(client, lenient_client):
    # The first prompt token's logprob is null, as OpenAI's legacy API sends it; the client's own
    # types say float there, so the echoed responses are read leniently.
    plain = client.completions.create(model=MODEL_NAME, prompt=[[11, 12, 13, 14]], max_tokens=3, logprobs=1,
                                      **GREEDY)
    echoed = lenient_client.completions.create(model=MODEL_NAME, prompt=[[11, 12, 13, 14]], max_tokens=3,
                                               logprobs=1, echo=True, **GREEDY)
    logprobs = echoed.choices[0].logprobs
    assert len(logprobs.tokens) == 4 + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing precedes it
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    # Same tokens; the values agree to float32 noise (the echoed prompt's rows share the LM head's matmul).
    assert logprobs.token_logprobs[4:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    streamed = lenient_client.completions.create(model=MODEL_NAME, prompt=[[11, 12, 13, 14]], max_tokens=3,
                                                 logprobs=1, echo=True, stream=True, **GREEDY)
    values = [v for chunk in streamed for choice in chunk.choices if choice.logprobs
              for v in choice.logprobs.token_logprobs]
    assert values == logprobs.token_logprobs


def test_logprobs_count_tokens_and_alternatives(client):
    response = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5, logprobs=2,
                                         **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 5
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_streams_equal_the_greedy_answer(lenient_client):
    prompts = ["hello world", "the cat sat"]
    whole = lenient_client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, **GREEDY)
    stream = lenient_client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, stream=True,
                                               stream_options={"include_usage": True}, echo=True, **GREEDY)
    texts, finishes, usage = {0: "", 1: ""}, {0: [], 1: []}, None
    for chunk in stream:
        assert chunk.object == "text_completion" and chunk.id.startswith("cmpl-")
        if not chunk.choices:
            usage = chunk.usage
            continue
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == {i: prompts[i] + whole.choices[i].text for i in (0, 1)}
    assert finishes == {0: ["length"], 1: ["length"]}
    assert usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_raw_stream_is_server_sent_events(server):
    body = {"prompt": "hello", "max_tokens": 3, "stream": True, "temperature": 0, "ignore_eos": True,
            "stop": {"Multiple": ["zzz"]}}
    status, headers, raw = http(server, "POST", "/v1/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    *chunks, done = sse_events(raw)
    assert done == "[DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
