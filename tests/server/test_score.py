"""POST /v1/score and /v1/rerank (with /score, /rerank, /v2/rerank) over a tiny BERT cross-encoder, on one rank and
through the engine core process; the oracle is sentence-transformers' ``CrossEncoder.predict``. Bad requests are
400s in OpenAI's error shape and the server goes on serving; a model that cannot score says so."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

from pluginfer.server.core_client import CoreProcessClient
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import http, make_client, server_config, start_engine

QUERY = "the quick brown fox"
DOCUMENTS = ["jumps over the lazy dog", "the sea is calm and grey", "a quick brown fox", "hello there"]
ATOL = 1e-5


def _start(config, core: bool):
    return CoreProcessClient(config).start() if core else start_engine(config)


@pytest.fixture(scope="module", params=[1, "core"], ids=["tp1", "core"])
def score_server(request, encoder_checkpoints) -> Iterator[BackgroundServer]:
    config = server_config(encoder_checkpoints["bert_cross"])
    engine = _start(config, request.param == "core")
    server = BackgroundServer(engine, config)
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def cross_encoder(encoder_checkpoints):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(encoder_checkpoints["bert_cross"]), device="cpu")


def post(server: BackgroundServer, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = http(server, "POST", path, body)
    return status, json.loads(raw)


def test_score_one_to_many_and_side_by_side(score_server, cross_encoder) -> None:
    status, body = post(score_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    expected = cross_encoder.predict([(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=ATOL, rtol=0)
    assert body["usage"]["prompt_tokens"] > 0
    queries = [QUERY, "weather", "sea", "hi"]
    status, body = post(score_server, "/score", {"text_1": queries, "text_2": DOCUMENTS, "model": "tiny-llama"})
    assert status == 200, body
    np.testing.assert_allclose([d["score"] for d in body["data"]], cross_encoder.predict(list(zip(queries, DOCUMENTS))),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_sorts_by_relevance(score_server, cross_encoder, path: str) -> None:
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2], {"text": DOCUMENTS[3]}]
    status, body = post(score_server, path, {"query": QUERY, "documents": documents, "top_n": 3})
    assert status == 200, body
    expected = cross_encoder.predict([(QUERY, d) for d in DOCUMENTS])
    order = list(np.argsort(-expected))[:3]
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], expected[order], atol=ATOL, rtol=0)
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
    status, body = post(score_server, path, {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
    assert status == 200 and len(body["results"]) == len(DOCUMENTS) and "document" not in body["results"][0]


@pytest.mark.parametrize(("path", "body", "names"), [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": "not a list"}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"content": "x"}]}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["ok", ""]}, "empty"),
    ("/v1/rerank", {"query": 7, "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "max_chunks_per_doc": 2}, "max_chunks_per_doc"),
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 has 2"),
    ("/v1/score", {"text_1": "a", "text_2": [1, 2]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ("/v1/score", {"text_1": {"text": "a"}, "text_2": "b"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": ["b"] * 3000}, "at most 2048"),
    ("/v1/rerank", {"query": " ".join(["word"] * 200), "documents": ["a"]}, "more than the model's context"),
])
def test_bad_requests_are_400_and_the_server_goes_on(score_server, path: str, body: dict, names: str) -> None:
    status, answer = post(score_server, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert names in error["message"] or names == error["param"], error
    assert http(score_server, "GET", "/health")[0] == 200
    assert post(score_server, "/v1/score", {"text_1": "a", "text_2": "b"})[0] == 200


def test_a_cross_encoder_does_not_embed(score_server) -> None:
    status, body = post(score_server, "/v1/embeddings", {"input": "hello"})
    assert status == 400 and "pooling config" in body["error"]["message"], body


def test_a_generative_model_cannot_rerank(tiny_llama_checkpoint) -> None:
    config = server_config(tiny_llama_checkpoint[0])
    engine = start_engine(config)
    server = BackgroundServer(engine, config)
    try:
        status, body = post(server, "/v1/rerank", {"query": "a", "documents": ["b"]})
        assert status == 400 and "cannot score" in body["error"]["message"], body
        with make_client(server) as client:  # still serving
            assert client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).choices
    finally:
        server.stop()
        engine.shutdown()


def test_a_yes_no_reranker_through_rerank_equals_transformers(tiny_llama_checkpoint) -> None:
    """--score-tokens on a causal LM: each document's relevance is sigmoid(logit(true) - logit(false)) at the
    last position of the pair, as transformers computes the logits."""
    import torch
    from transformers import AutoTokenizer

    path, model = tiny_llama_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    false, true = tokenizer.convert_ids_to_tokens([300, 301])
    config = server_config(path, score_tokens=[false, true])
    engine = start_engine(config)
    server = BackgroundServer(engine, config)
    try:
        status, body = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    finally:
        server.stop()
        engine.shutdown()
    assert status == 200, body
    expected = []
    for document in DOCUMENTS:
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer(QUERY, document)["input_ids"]])).logits[0, -1]
        expected.append(torch.sigmoid(logits[301] - logits[300]).item())
    order = list(np.argsort(-np.array(expected)))[:2]
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], np.array(expected)[order],
                               atol=ATOL, rtol=0)
