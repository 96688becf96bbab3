"""Encoder models and scores through the offline API, against independent implementations:
sentence-transformers' ``SentenceTransformer.encode`` (BERT, XLM-RoBERTa embeddings) and ``CrossEncoder.predict``
(cross-encoders), and transformers' logits for a causal LM scored from two tokens (Qwen3-Reranker's recipe) and for
``--pooling`` on a causal LM without sentence-transformers files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pluginfer import LLM
from pluginfer.engine.pooling import PoolingParams

# (the second is longer than ModernBERT's local window of 8 tokens: its local layers see part of it)
TEXTS = ["the quick brown fox", "a much longer sentence about the weather, the sea and the hills today", "hi",
         "The Quick Brown Fox!"]
QUERIES = ["the quick brown fox", "weather today", "hi"]
DOCUMENTS = ["jumps over the lazy dog", "the sea is calm and grey", "hello there, my old friend"]
ATOL = 1e-5
SMALL = {"cache.kv_cache_memory": 2**20, "dtype": "float32"}


@pytest.mark.parametrize("name", ["bert", "xlm_roberta", "modernbert"])
def test_embeddings_equal_sentence_transformers(encoder_checkpoints, name: str) -> None:
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(encoder_checkpoints[name]), device="cpu").encode(TEXTS)
    with LLM(str(encoder_checkpoints[name]), **SMALL) as llm:
        got = np.array([output.embedding for output in llm.embed(TEXTS)])
    assert got.shape == expected.shape and np.abs(expected).max() > 0.05
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    assert np.abs(got[0] - got[1]).max() > 1e-3


@pytest.mark.parametrize("name", ["bert_cross", "xlm_roberta_cross", "bert_cross_identity", "modernbert_cross"])
def test_cross_encoder_scores_equal_sentence_transformers(encoder_checkpoints, name: str) -> None:
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(encoder_checkpoints[name]), device="cpu").predict(list(zip(QUERIES, DOCUMENTS)))
    with LLM(str(encoder_checkpoints[name]), **SMALL) as llm:
        side_by_side = [output.score for output in llm.score(QUERIES, DOCUMENTS)]
        one_to_many = [output.score for output in llm.score(QUERIES[0], DOCUMENTS)]
    np.testing.assert_allclose(side_by_side, expected, atol=ATOL, rtol=0)
    expected_one = CrossEncoder(str(encoder_checkpoints[name]), device="cpu").predict(
        [(QUERIES[0], document) for document in DOCUMENTS])
    np.testing.assert_allclose(one_to_many, expected_one, atol=ATOL, rtol=0)


@pytest.mark.slow  # two spawned ranks
def test_two_tensor_parallel_ranks_equal_sentence_transformers(encoder_checkpoints) -> None:
    from sentence_transformers import CrossEncoder, SentenceTransformer

    expected = SentenceTransformer(str(encoder_checkpoints["bert"]), device="cpu").encode(TEXTS)
    with LLM(str(encoder_checkpoints["bert"]), tensor_parallel_size=2, **SMALL) as llm:
        got = np.array([output.embedding for output in llm.embed(TEXTS)])
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    for name in ("xlm_roberta_cross", "modernbert_cross"):  # ModernBERT's fused Wqkv and Wi split per rank
        cross = encoder_checkpoints[name]
        expected = CrossEncoder(str(cross), device="cpu").predict(list(zip(QUERIES, DOCUMENTS)))
        with LLM(str(cross), tensor_parallel_size=2, **SMALL) as llm:
            got = [output.score for output in llm.score(QUERIES, DOCUMENTS)]
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_bert_pairs_carry_token_types(encoder_checkpoints) -> None:
    """The second text's token type changes the score: swapping the texts gives another (BERT reads types)."""
    with LLM(str(encoder_checkpoints["bert_cross"]), **SMALL) as llm:
        (ab,), (ba,) = llm.score("alpha beta", "gamma delta"), llm.score("gamma delta", "alpha beta")
    assert any(token >> 30 == 1 for token in ab.prompt_token_ids)
    assert abs(ab.score - ba.score) > 1e-4


def test_prompts_that_do_not_share_a_step_wait_whole_rather_than_chunk(encoder_checkpoints) -> None:
    """A step of 16 tokens holds one of these ~10-token prompts: the next waits for the next step (an encoder's
    prompt cut over two steps would attend to half of itself)."""
    from sentence_transformers import SentenceTransformer

    texts = ["the quick brown fox jumps", "hills and rivers far away", "a brown fox and a dog"]
    expected = SentenceTransformer(str(encoder_checkpoints["bert"]), device="cpu").encode(texts)
    with LLM(str(encoder_checkpoints["bert"]), **SMALL, **{"scheduler.max_num_batched_tokens": 16}) as llm:
        lengths = [len(llm.get_tokenizer().encode(text)) for text in texts]
        got = np.array([output.embedding for output in llm.embed(texts)])
    assert all(8 < n <= 16 for n in lengths), lengths
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_an_encoder_prompt_longer_than_a_step_is_refused(encoder_checkpoints) -> None:
    with LLM(str(encoder_checkpoints["bert"]), **SMALL, **{"scheduler.max_num_batched_tokens": 16}) as llm:
        with pytest.raises(ValueError, match="max_num_batched_tokens 16"):
            llm.embed(" ".join(["word"] * 40))
        assert len(llm.embed(["short", "also short"])) == 2  # several whole prompts still share steps


def test_embedding_model_cannot_score_and_cross_encoder_cannot_embed(encoder_checkpoints) -> None:
    with LLM(str(encoder_checkpoints["bert"]), **SMALL) as llm:
        with pytest.raises(ValueError, match="cannot score"):
            llm.score("a", "b")
    with LLM(str(encoder_checkpoints["bert_cross"]), **SMALL) as llm:
        with pytest.raises(ValueError, match="does not embed"):
            llm.embed("a")
        with pytest.raises(ValueError, match="cannot generate|without an LM head|embeddings only"):
            llm.generate("a")


def test_yes_no_reranker_equals_transformers_logits(tiny_llama_checkpoint) -> None:
    """sigmoid(logit(true) - logit(false)) at the last position of the pair's tokens (vLLM's recipe)."""
    from transformers import AutoTokenizer

    path, model = tiny_llama_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    false, true = tokenizer.convert_ids_to_tokens([300, 301])
    with LLM(str(path), score_tokens=[false, true], **SMALL) as llm:
        outputs = llm.score(QUERIES, DOCUMENTS)
        assert llm.generate("hello", None)[0].outputs[0].token_ids  # still generates
        with pytest.raises(ValueError, match="does not embed"):
            llm.embed("hello")
    for (query, document), output in zip(zip(QUERIES, DOCUMENTS), outputs):
        ids = tokenizer(query, document)["input_ids"]
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        assert output.score == pytest.approx(torch.sigmoid(logits[301] - logits[300]).item(), abs=ATOL)


def test_score_tokens_not_in_the_vocabulary_are_named(tiny_llama_checkpoint) -> None:
    with LLM(str(tiny_llama_checkpoint[0]), score_tokens=["nope-not-a-token", "yes"], **SMALL) as llm:
        with pytest.raises(ValueError, match="nope-not-a-token"):
            llm.score("a", "b")


@pytest.mark.parametrize("method", ["mean", "last", "cls"])
def test_pooling_flag_on_a_causal_lm_without_pooling_files(tiny_llama_checkpoint, method: str) -> None:
    path, model = tiny_llama_checkpoint
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(path))(TEXTS[1])["input_ids"]
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    pooled = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[method]
    expected = torch.nn.functional.normalize(pooled, dim=0)
    with LLM(str(path), pooling=method, **SMALL) as llm:
        got = torch.tensor(llm.embed(ids, PoolingParams())[0].embedding)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
    ({"hidden_act": "mish"}, "hidden_act"),
    ({"is_decoder": True}, "is_decoder"),
    ({"hidden_size": 66}, "not a multiple of num_attention_heads"),
])
def test_config_values_the_encoder_does_not_implement_are_named(encoder_checkpoints, tmp_path, changes: dict,
                                                                 pattern: str) -> None:
    from tests.checkpoints import assert_config_rejected

    assert_config_rejected(encoder_checkpoints["bert"], tmp_path / "bert", changes, pattern)


def test_a_context_past_the_position_table_is_named(encoder_checkpoints) -> None:
    """XLM-RoBERTa's positions start at pad_token_id + 1: max_position_embeddings 130 leaves 128."""
    with LLM(str(encoder_checkpoints["xlm_roberta"]), **SMALL) as llm:
        assert llm.engine.max_model_len == 128
    with pytest.raises(ValueError, match="max_model_len: 129 exceeds"):
        LLM(str(encoder_checkpoints["xlm_roberta"]), max_model_len=129, **SMALL)
