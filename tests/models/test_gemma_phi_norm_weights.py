"""Every gemma/phi norm weight (and LayerNorm bias) reaches the right place: random norms, not HF's init.

transformers initializes Gemma's ``(1 + w)`` norms with w = 0 and LayerNorms with ones/zeros, so in
test_families.py every norm is the identity and a swapped one (say Gemma 2's pre- and post-feed-forward
norms) would pass there; here each norm is different.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pluginfer import LLM
from tests.checkpoints import hf_logits, prefill_logits, random_prompts, save_hf_model
from tests.models.family_cases_gemma_phi import CASES as FAMILY_CASES
from tests.models.test_families import BASE

CASES = ["gemma", "gemma2-softcap-window-12", "gemma3-local-global-window-8", "phi2-qk-layernorm-rotary-0.75",
         "phi3-window-16"]


@pytest.mark.parametrize("case", CASES)
def test_random_norm_weights_match_transformers(case: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    arch, overrides = FAMILY_CASES[case][:2]
    model = save_hf_model(arch, {**BASE, **overrides}, tmp_path, tiny_tokenizer_dir)
    generator = torch.Generator().manual_seed(7)
    norms = [param for name, param in model.named_parameters() if "norm" in name]
    assert norms
    with torch.no_grad():
        for param in norms:
            param.add_(0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32, block_size=8)
    for prompt in random_prompts(model.config.vocab_size, [7, 30], seed=3):
        ours, theirs = prefill_logits(llm, prompt), hf_logits(model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (case, (ours - theirs).abs().max())
