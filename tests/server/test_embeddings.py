"""POST /v1/embeddings through the official openai client (sync and async), on one rank, two
tensor-parallel ranks and the engine core process; the oracle is sentence-transformers' ``encode``
on the same checkpoint directory."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch

from pluginfer.server.core_client import CoreProcessClient
from pluginfer.server.embeddings import EmbeddingRequest
from pluginfer.server.launch import BackgroundServer
from tests.embedding_models import QWEN3_MATRYOSHKA, sentence_transformer
from tests.server.conftest import (
    MODEL_NAME,
    http,
    make_async_client,
    make_client,
    server_config,
    start_engine,
)
from tests.server.test_request_fields import SPEC, spec_fields

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog, again and again", "a",
         "Embeddings of sentences of rather different lengths, batched together."]
ATOL = 2e-5
# CreateEmbeddingRequest's fields, and the test that shows each one doing what OpenAI says it does.
FIELDS = {
    "input": "test_sync_client_equals_sentence_transformers",
    "model": "test_wrong_model_is_404",
    "encoding_format": "test_float_and_base64_are_the_same_vector",
    "dimensions": "test_dimensions_truncate_and_renormalize",
    "user": "test_float_and_base64_are_the_same_vector",
}


@pytest.fixture(scope="module", params=[1, 2, "core"], ids=["tp1", "tp2", "core"])
def embedding_server(request, embedding_checkpoints) -> Iterator[BackgroundServer]:
    """A server over the tiny Qwen3 embedding checkpoint (last-token pooling, Normalize, Matryoshka)."""
    config = server_config(embedding_checkpoints["qwen3"], **{"parallel.tensor_parallel_size": 1
                                                             if request.param == "core" else request.param})
    engine = CoreProcessClient(config).start() if request.param == "core" else start_engine(config)
    server = BackgroundServer(engine, config)
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(embedding_checkpoints) -> torch.Tensor:
    model = sentence_transformer(embedding_checkpoints["qwen3"])
    return model.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS)).float()


def _vectors(response) -> torch.Tensor:
    assert [item.index for item in response.data] == list(range(len(response.data)))
    return torch.tensor([item.embedding for item in response.data])


def test_sync_client_equals_sentence_transformers(embedding_server, expected):
    # Without encoding_format the client asks for base64 and decodes it after parsing; its strict response
    # validation (a test-only option) would check the base64 string against the list type first.
    with make_client(embedding_server, strict=False) as client:
        response = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    with make_client(embedding_server) as client:
        one = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1], encoding_format="float")
    torch.testing.assert_close(_vectors(response), expected, atol=ATOL, rtol=0)
    assert response.object == "list" and response.model == MODEL_NAME
    assert response.data[0].object == "embedding"
    torch.testing.assert_close(_vectors(one)[0], expected[1], atol=ATOL, rtol=0)
    tokens = [len(embedding_server.engine.tokenizer.encode(t)) for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(tokens)


def test_async_client_concurrent_requests(embedding_server, expected):
    async def run() -> list:
        async with make_async_client(embedding_server, strict=False) as client:  # base64, decoded by the client
            return await asyncio.gather(*(client.embeddings.create(model=MODEL_NAME, input=text) for text in TEXTS))

    responses = asyncio.run(run())
    got = torch.stack([_vectors(response)[0] for response in responses])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_token_arrays_equal_text(embedding_server, expected):
    tokenizer = embedding_server.engine.tokenizer
    ids = [tokenizer.encode(t) for t in TEXTS]
    with make_client(embedding_server) as client:
        batch = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
        single = client.embeddings.create(model=MODEL_NAME, input=ids[0], encoding_format="float")
    torch.testing.assert_close(_vectors(batch), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(_vectors(single)[0], expected[0], atol=ATOL, rtol=0)


def test_float_and_base64_are_the_same_vector(embedding_server):
    body = {"model": MODEL_NAME, "input": TEXTS[:2], "user": "someone"}
    status, _, raw = http(embedding_server, "POST", "/v1/embeddings", {**body, "encoding_format": "float"})
    assert status == 200, raw
    floats = json.loads(raw)
    status, _, raw = http(embedding_server, "POST", "/v1/embeddings", {**body, "encoding_format": "base64"})
    assert status == 200, raw
    encoded = json.loads(raw)
    for plain, packed in zip(floats["data"], encoded["data"]):
        decoded = np.frombuffer(base64.b64decode(packed["embedding"]), dtype="<f4")
        # Two requests, each computed anew: the second's last token may come from the prefix cache (last-token
        # pooling reuses it) and run the decode kernels instead of the prefill ones, and the step's batch may
        # differ (seen through the engine core process: 1.3e-7 apart on values of ~0.1). The encodings
        # themselves are exact: float32 -> JSON -> float32 and base64 both round-trip bit for bit.
        np.testing.assert_allclose(decoded, np.asarray(plain["embedding"], dtype=np.float32), rtol=0, atol=1e-6)
    assert floats["usage"] == encoded["usage"]


def test_dimensions_truncate_and_renormalize(embedding_server, expected):
    with make_client(embedding_server) as client:
        for dims in QWEN3_MATRYOSHKA:
            response = client.embeddings.create(model=MODEL_NAME, input=TEXTS, dimensions=dims,
                                                encoding_format="float")
            want = torch.nn.functional.normalize(expected[:, :dims], dim=1)
            torch.testing.assert_close(_vectors(response), want, atol=ATOL, rtol=0)
        with pytest.raises(openai.BadRequestError) as error:
            client.embeddings.create(model=MODEL_NAME, input="hi", dimensions=20)
    assert error.value.body["param"] == "dimensions"
    assert "must be one of [16, 32, 64], got 20" in error.value.body["message"]


def test_wrong_model_is_404(embedding_server):
    status, _, raw = http(embedding_server, "POST", "/v1/embeddings", {"model": "other", "input": "hi"})
    assert status == 404 and json.loads(raw)["error"]["param"] == "model"
    status, _, raw = http(embedding_server, "POST", "/v1/embeddings", {"input": "hi"})  # the served model
    assert status == 200, raw


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, "input", "input 0 is empty"),
    ({"input": []}, "input", "must be a non-empty string"),
    ({"input": [[]]}, "input", "input 0 is empty"),
    ({"input": ["ok", ""]}, "input", "input 1 is empty"),
    ({"input": ["ok", [1, 2]]}, "input", "must be a string, a list of strings"),
    ({"input": [True]}, "input", "must be a string"),
    ({"input": 5}, "input", "must be a non-empty string"),
    ({"input": ["x"] * 2049}, "input", "at most 2048 inputs"),
    ({"input": [[7] * 300]}, "input", "input 0 has 300 tokens, more than the model's context of 256 tokens"),
    ({"input": [[7, 10**9]]}, "input", "prompt token ids must be integers in"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "must be an integer >= 1"),
    ({"input": "hi", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "unknown field"),
])
def test_bad_input_is_400_naming_the_field(embedding_server, body, param, words):
    status, _, raw = http(embedding_server, "POST", "/v1/embeddings", body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and words in error["message"], raw


def test_every_spec_field_is_declared_and_tested():
    fields = spec_fields(json.loads(SPEC.read_text()), "CreateEmbeddingRequest") if SPEC.is_file() else list(FIELDS)
    assert sorted(fields) == sorted(FIELDS)
    assert set(FIELDS) <= set(EmbeddingRequest.model_fields)
    assert all(callable(globals()[test]) for test in FIELDS.values())


def test_a_model_without_pooling_config_is_400_saying_what_is_missing(tiny_llama_checkpoint):
    config = server_config(tiny_llama_checkpoint[0])
    engine = start_engine(config)
    server = BackgroundServer(engine, config)
    try:
        status, _, raw = http(server, "POST", "/v1/embeddings", {"input": "hi"})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "model", raw
        assert "this model has no pooling config" in error["message"] and "modules.json is missing" in error["message"]
        assert str(tiny_llama_checkpoint[0]) not in error["message"]  # the server's paths stay on the server
        status, _, raw = http(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200, raw  # the model still generates
    finally:
        server.stop()
        engine.shutdown()


def test_generation_on_an_embedding_only_checkpoint_is_400(embedding_server):
    status, _, raw = http(embedding_server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    error = json.loads(raw)["error"]
    assert status == 400 and "without an LM head" in error["message"] and "serves embeddings only" in error["message"]
