"""YaRN frequencies and attention factor against transformers' ``_compute_yarn_parameters`` (DeepSeek configs)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pluginfer.backends.cpu import backend as cpu
from pluginfer.layers.context import building
from pluginfer.layers.rotary import YarnRotaryEmbedding
from tests.layers.conftest import make_context

ROPE_DIM, MAX_POSITIONS = 16, 512

CASES = {
    "deepseek-v3-like": {"factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    "mscale-differs": {"factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.707,
                       "mscale_all_dim": 1.0},
    "no-mscale": {"factor": 8.0, "original_max_position_embeddings": 64},
    "factor-from-lengths": {"factor": None, "original_max_position_embeddings": 128},
    "untruncated-ramp": {"factor": 4.0, "original_max_position_embeddings": 64, "truncate": False,
                         "beta_fast": 16, "beta_slow": 2},
    "explicit-attention-factor": {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_yarn_matches_transformers(case: str) -> None:
    scaling = {"rope_type": "yarn", "rope_theta": 10000.0, **CASES[case]}
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=ROPE_DIM,
                              max_position_embeddings=MAX_POSITIONS, rope_parameters=dict(scaling))
    theirs_inv_freq, theirs_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    with building(make_context(cpu.build())):
        ours = YarnRotaryEmbedding(ROPE_DIM, ROPE_DIM, MAX_POSITIONS, 10000.0, scaling, MAX_POSITIONS,
                                   is_neox_style=False)
    torch.testing.assert_close(ours.inv_freq, theirs_inv_freq.float(), atol=0, rtol=1e-6)
    assert ours.attention_factor == pytest.approx(theirs_factor, rel=1e-12)
    positions = torch.arange(MAX_POSITIONS, dtype=torch.float32)[:, None] * theirs_inv_freq[None, :].float()
    torch.testing.assert_close(ours.cos_cache, positions.cos() * theirs_factor, atol=1e-6, rtol=0)
