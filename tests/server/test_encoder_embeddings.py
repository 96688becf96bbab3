"""/v1/embeddings from an XLM-RoBERTa encoder (oracle: sentence-transformers' ``encode``) and from a causal LM
without sentence-transformers files served with ``--pooling`` (oracle: transformers' hidden states pooled by hand),
through the official openai client."""

from __future__ import annotations

import numpy as np
import torch

from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import MODEL_NAME, make_client, server_config, start_engine

TEXTS = ["the quick brown fox", "hi", "a longer sentence about the sea"]
ATOL = 1e-5


def _embed(checkpoint, texts: list[str], **overrides) -> np.ndarray:
    config = server_config(checkpoint, **overrides)
    engine = start_engine(config)
    server = BackgroundServer(engine, config)
    try:
        with make_client(server) as client:
            data = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float").data
    finally:
        server.stop()
        engine.shutdown()
    return np.array([item.embedding for item in data])


def test_encoder_embeddings_equal_sentence_transformers(encoder_checkpoints) -> None:
    from sentence_transformers import SentenceTransformer

    got = _embed(encoder_checkpoints["xlm_roberta"], TEXTS)
    expected = SentenceTransformer(str(encoder_checkpoints["xlm_roberta"]), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_pooling_flag_embeds_with_a_causal_lm(tiny_llama_checkpoint) -> None:
    from transformers import AutoTokenizer

    path, model = tiny_llama_checkpoint
    got = _embed(path, TEXTS, pooling="mean")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    for text, vector in zip(TEXTS, got):
        with torch.no_grad():
            hidden = model.model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0]
        expected = torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()
        np.testing.assert_allclose(vector, expected, atol=ATOL, rtol=0)
