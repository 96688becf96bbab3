"""Hub checkpoints' config.json predates transformers 5's rewrite (rope_parameters, layer_types).

Each case saves a model with transformers, rewrites its config.json the way the hub spells the same
settings, and checks our prefill logits still match the model transformers built.
"""

from __future__ import annotations

import json

import pytest
import torch

from pluginfer import LLM
from tests.checkpoints import hf_logits, prefill_logits, random_prompts, save_hf_model
from tests.models.test_families import BASE

_SLIDING, _FULL = "sliding_attention", "full_attention"
SHORT, LONG = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5], [2.0] * 8

# name: (architecture, config for transformers, fields to drop from config.json, hub fields to add)
CASES = {
    "gemma2-alternating": ("Gemma2ForCausalLM", {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8},
                           ["layer_types"], {"hidden_act": "gelu_pytorch_tanh"}),
    "gemma3-pattern-local-base": ("Gemma3ForCausalLM", {
        "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8, "layer_types": [_SLIDING, _SLIDING, _FULL],
        "rope_parameters": {_FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
                            _SLIDING: {"rope_type": "default", "rope_theta": 5_000.0}}},
        ["layer_types", "rope_parameters"],
        {"sliding_window_pattern": 3, "rope_theta": 100_000.0, "rope_local_base_freq": 5_000.0,
         "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "phi3-rope-scaling-type-longrope": ("Phi3ForCausalLM", {
        "original_max_position_embeddings": 256, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10_000.0, "factor": 4.0, "short_factor": SHORT,
            "long_factor": LONG}},
        ["rope_parameters"],
        {"rope_theta": 10_000.0, "rope_scaling": {"type": "longrope", "factor": 4.0, "short_factor": SHORT,
                                                  "long_factor": LONG}}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hub_spelled_config_matches_transformers(name: str, tmp_path, tiny_tokenizer_dir) -> None:
    arch, overrides, dropped, added = CASES[name]
    model = save_hf_model(arch, {**BASE, **overrides}, tmp_path, tiny_tokenizer_dir)
    config = json.loads((tmp_path / "config.json").read_text())
    for field in dropped:
        assert field in config, field  # the rewrite really removes what transformers 5 wrote
        del config[field]
    (tmp_path / "config.json").write_text(json.dumps({**config, **added}))
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32, block_size=8)
    prompt = random_prompts(model.config.vocab_size, [60], seed=3)[0]
    ours, theirs = prefill_logits(llm, prompt), hf_logits(model, prompt)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (name, (ours - theirs).abs().max())
