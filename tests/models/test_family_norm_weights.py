"""Every norm weight (and LayerNorm bias) reaches the right place: random norms instead of HF's ones/zeros.

test_families.py checks the families as transformers initializes them, where every norm weight is one;
a swapped or misrouted norm (e.g. StableLM's per-head q/k LayerNorms) would pass there, not here.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pluginfer import LLM
from tests.checkpoints import hf_logits, save_hf_model
from tests.models.test_llama import prefill_logits

# The shape test_families.py uses (not imported: that module collects every family's case module).
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)

CASES = {
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {"head_dim": 16}),
    "glm4-four-norms": ("Glm4ForCausalLM", {"head_dim": 16}),
    "stablelm-per-head-qk-layernorm": ("StableLmForCausalLM", {"qk_layernorm": True}),
    "stablelm-parallel-residual": ("StableLmForCausalLM", {"qk_layernorm": True, "use_parallel_residual": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_random_norm_weights_match_transformers(case: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    arch, overrides = CASES[case]
    model = save_hf_model(arch, {**BASE, **overrides}, tmp_path, tiny_tokenizer_dir)
    generator = torch.Generator().manual_seed(7)
    norms = [(name, param) for name, param in model.named_parameters() if "norm" in name]
    assert norms
    with torch.no_grad():
        for name, param in norms:
            base = 1.0 if name.endswith("weight") else 0.0
            param.copy_(base + 0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32, block_size=8)
    rng = random.Random(3)
    for prompt in ([rng.randrange(10, model.config.vocab_size) for _ in range(n)] for n in (7, 30)):
        ours, theirs = prefill_logits(llm, prompt), hf_logits(model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (case, (ours - theirs).abs().max())
