"""LoRA adapters beyond a generation: beam search under adapters against peft's ``generate(num_beams=...)``,
embeddings of decoder embedding models against transformers + peft, and a BERT cross-encoder's scores and
embedding model's embeddings against sentence-transformers with the adapter loaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import random_prompts
from tests.engine.test_lora import ADAPTERS, ALL_TARGETS, lora_setup, make_llm, save_adapter

pytest.importorskip("peft")
__all__ = ["lora_setup"]  # the fixture (a base and its adapters), used here too


def test_beam_search_with_adapters_equals_peft(lora_setup: tuple) -> None:
    """``LLM.beam_search`` under an adapter, and with one adapter per prompt (the base, two adapters): the beams
    and scores of peft's ``generate(num_beams=...)``; the same prompt under two adapters is two searches."""
    from pluginfer.engine.beam_search import BeamSearchParams
    from pluginfer.engine.lora_request import LoRARequest
    from tests.checkpoints import hf_beams, padded

    root, base, peft_models = lora_setup
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    prompt = random_prompts(base.config.vocab_size, [6], seed=8)[0]
    eos = base.generation_config.eos_token_id
    want = {name: hf_beams(base if name is None else peft_models[name], prompt, params, eos)
            for name in (None, "all", "attn")}
    assert want["all"][0] != want[None][0] and want["attn"][0] != want[None][0]
    requests = {name: LoRARequest(name, i, str(root / name)) for i, name in enumerate(ADAPTERS, start=1)}
    with make_llm(root, dtype="float32") as llm:
        for names, results in (
                (["all"], llm.beam_search([prompt], params, lora_request=requests["all"])),
                ([None, "all", "attn"], llm.beam_search([prompt] * 3, params,
                                                        lora_request=[None, requests["all"], requests["attn"]]))):
            for name, beams in zip(names, results):
                tokens, scores = want[name]
                assert [padded(b.token_ids, len(tokens[0]), eos) for b in beams] == tokens, name
                assert [b.score for b in beams] == pytest.approx(scores, abs=1e-4), name
        with pytest.raises(ValueError, match="got 1 LoRA requests for 2 prompts"):
            llm.beam_search([prompt, prompt], params, lora_request=[requests["all"]])


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_embeddings_under_an_adapter_equal_peft(embedding_checkpoints: dict, tmp_path: Path, name: str) -> None:
    """``LLM.embed`` under an adapter made on the embedding checkpoint's decoder as transformers' AutoModel loads
    it (a bare ``Qwen3Model``'s names: ``layers.0...``): the hidden states of transformers + peft pooled as the
    checkpoint says (last token and normalized; the mean), within 2e-5; the base and the adapter mixed in one
    batch, each prompt its own."""
    from transformers import AutoModel, AutoTokenizer

    from pluginfer import LLM
    from pluginfer.engine.lora_request import LoRARequest
    from pluginfer.engine.pooling import read_pooler_config

    path = embedding_checkpoints[name]
    pooler = read_pooler_config(path, json.loads((path / "config.json").read_text()))
    base = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    model = save_adapter(base, tmp_path / "adapter", 3, r=4, lora_alpha=8, target_modules=ALL_TARGETS)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "sentences of other lengths"]

    def pooled(hidden: torch.Tensor) -> torch.Tensor:
        vector = hidden[-1] if pooler.method == "last" else hidden.mean(dim=0)
        return torch.nn.functional.normalize(vector, dim=0) if pooler.normalize else vector

    def oracle() -> torch.Tensor:
        with torch.inference_mode():
            return torch.stack([pooled(model(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0]) for t in texts])

    want = oracle()
    with model.disable_adapter():
        plain = oracle()
    assert (want - plain).abs().max() > 1e-2
    request = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    with LLM(str(path), dtype="float32", num_blocks=64, block_size=8, enable_lora=True, max_loras=1,
             max_lora_rank=4) as llm:
        got = torch.tensor([o.embedding for o in llm.embed(texts, lora_request=request)])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        mixed = torch.tensor([o.embedding for o in llm.embed(texts, lora_request=[request, None, None, request])])
        torch.testing.assert_close(mixed, torch.stack([want[0], plain[1], plain[2], want[3]]), atol=2e-5, rtol=0)


def test_encoder_scores_and_embeddings_under_an_adapter_equal_sentence_transformers(encoder_checkpoints: dict,
                                                                                   tmp_path: Path) -> None:
    """A BERT cross-encoder's scores and a BERT embedding model's embeddings under a peft adapter made on the
    checkpoint's transformers class (``bert.encoder...`` names; query, key and value fused here): those of
    sentence-transformers with the adapter loaded (``load_adapter``, peft's own loading), and with the base's
    in the same batch."""
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from transformers import AutoModel, AutoModelForSequenceClassification

    from pluginfer import LLM
    from pluginfer.engine.lora_request import LoRARequest

    targets = ["query", "key", "value", "attention.output.dense", "intermediate.dense"]
    queries, documents = ["the quick brown fox", "weather today"], ["jumps over the lazy dog", "the sea is calm"]
    settings = dict(dtype="float32", num_blocks=64, block_size=8, enable_lora=True, max_loras=1, max_lora_rank=4)
    cross = encoder_checkpoints["bert_cross"]
    save_adapter(AutoModelForSequenceClassification.from_pretrained(str(cross)), tmp_path / "cross", 5, r=4,
                 lora_alpha=8, target_modules=targets)
    oracle = CrossEncoder(str(cross), device="cpu")
    plain = oracle.predict(list(zip(queries, documents)))
    oracle.load_adapter(str(tmp_path / "cross"))
    want = oracle.predict(list(zip(queries, documents)))
    assert abs(want - plain).max() > 1e-2
    request = LoRARequest("cross", 1, str(tmp_path / "cross"))
    with LLM(str(cross), **settings) as llm:
        got = [o.score for o in llm.score(queries, documents, lora_request=request)]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        mixed = [o.score for o in llm.score(queries, documents, lora_request=[None, request])]
        np.testing.assert_allclose(mixed, [plain[0], want[1]], atol=1e-5, rtol=0)
    embedder = encoder_checkpoints["bert"]
    save_adapter(AutoModel.from_pretrained(str(embedder)), tmp_path / "embed", 6, r=4, lora_alpha=8,
                 target_modules=targets)
    oracle = SentenceTransformer(str(embedder), device="cpu")
    oracle.load_adapter(str(tmp_path / "embed"))
    want = oracle.encode(queries)
    with LLM(str(embedder), **settings) as llm:
        got = [o.embedding for o in llm.embed(queries, lora_request=LoRARequest("embed", 2, str(tmp_path / "embed")))]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
