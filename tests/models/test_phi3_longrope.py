"""Phi-3 LongRoPE's long factors through the whole engine, against transformers.

A run whose max_model_len exceeds original_max_position_embeddings uses the long factors for every
sequence (see LongRopeEmbedding); transformers does so for sequences longer than that, which these are.
"""

from __future__ import annotations

import pytest
import torch

from pluginfer import LLM
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts, save_hf_model
from tests.models.test_families import BASE

ORIGINAL = 48
CONFIG = {**BASE, "original_max_position_embeddings": ORIGINAL, "partial_rotary_factor": 0.75,
          "rope_parameters": {"rope_type": "longrope", "rope_theta": 10_000.0,
                              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                              "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0]}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    out = tmp_path_factory.mktemp("phi3-longrope")
    return out, save_hf_model("Phi3ForCausalLM", CONFIG, out, tiny_tokenizer_dir)


def test_sequences_past_the_original_length_match_transformers(checkpoint) -> None:
    path, model = checkpoint
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8)  # max_model_len 256 > 48
    assert llm.engine.executor.pipeline.model.layers[0].self_attn.rotary_emb.use_long_factors
    for prompt in random_prompts(model.config.vocab_size, [49, 60], seed=0):
        ours, theirs = prefill_logits(llm, prompt), hf_logits(model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
    prompts = random_prompts(model.config.vocab_size, [50, 57], seed=1)
    outputs = llm.generate(prompts, greedy(16))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 16) for p in prompts]


def test_a_run_within_the_original_length_uses_the_short_factors(checkpoint) -> None:
    path, model = checkpoint
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, max_model_len=ORIGINAL)
    prompts = random_prompts(model.config.vocab_size, [20, 31], seed=2)
    outputs = llm.generate(prompts, greedy(16))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 16) for p in prompts]
