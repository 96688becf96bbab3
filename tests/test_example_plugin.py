"""The worked out-of-tree plugin (plugins/pluginfer-example-granite) is discovered and equals transformers."""

from __future__ import annotations

import importlib.metadata
import random

import pytest
import torch

from pluginfer import LLM, SamplingParams
from pluginfer.core.registry import Registry
from tests.checkpoints import hf_greedy, hf_logits, prefill_logits, save_hf_model

try:
    importlib.metadata.distribution("pluginfer-example-granite")
except importlib.metadata.PackageNotFoundError:  # the README test command installs it
    pytest.skip("plugins/pluginfer-example-granite is not installed (pip install ./plugins/...)",
                allow_module_level=True)

GRANITE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
               embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.4, logits_scaling=2.5)


def test_the_installed_plugin_is_discovered():
    registry = Registry.discover()
    info = next(p for p in registry.plugins if p.distribution == "pluginfer-example-granite")
    assert info.error is None and info.version == "0.1.0"
    assert registry.resolve("model", "GraniteForCausalLM").factory == "pluginfer_granite.model:build"


def test_granite_plugin_matches_transformers(tmp_path, tiny_tokenizer_dir):
    model = save_hf_model("GraniteForCausalLM", GRANITE, tmp_path, tiny_tokenizer_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, model.config.vocab_size) for _ in range(n)] for n in (7, 19, 30)]
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, block_size=8)
    for prompt in prompts:
        assert torch.allclose(prefill_logits(llm, prompt), hf_logits(model, prompt), atol=1e-4, rtol=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 24) for p in prompts]
