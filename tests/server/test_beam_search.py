"""use_beam_search through the official openai client: the n best beams equal transformers' num_beams search."""

from __future__ import annotations

import json

import pytest
import torch

from tests.server.conftest import MODEL_NAME, http

PROMPT = [11, 12, 13, 14, 15]


def test_completion_beams_equal_transformers(client, tiny_llama_checkpoint, async_engine):
    model = tiny_llama_checkpoint[1]
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        expected = model.generate(torch.tensor([PROMPT]), num_beams=3, num_return_sequences=3, max_new_tokens=8,
                                  do_sample=False, eos_token_id=eos, pad_token_id=eos)
    tokenizer = async_engine.tokenizer
    texts = [tokenizer.decode(row[len(PROMPT):], skip_special_tokens=True) for row in expected.tolist()]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=3, max_tokens=8, temperature=0,
                                         extra_body={"use_beam_search": True, "length_penalty": 1.0})
    assert [choice.text for choice in response.choices] == texts
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert {choice.finish_reason for choice in response.choices} <= {"stop", "length"}


def test_chat_beams_are_the_choices(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=2,
                                              max_tokens=6, extra_body={"use_beam_search": True,
                                                                        "early_stopping": True})
    assert len(response.choices) == 2 and all(isinstance(c.message.content, str) for c in response.choices)
    assert response.usage.completion_tokens > 0


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": 0.7}, "temperature"),
    ({"stream": True}, "stream"),
    ({"n": 11}, "n"),
    ({"top_p": 0.5}, "top_p"),
    ({"logprobs": 2}, "logprobs"),
])
def test_what_beam_search_does_not_apply_is_400(server, fields, param):
    body = {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, "n": 2, **fields}
    status, _, raw = http(server, "POST", "/v1/completions", body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, error
