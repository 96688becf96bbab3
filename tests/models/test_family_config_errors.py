"""Config fields the qwen, glm4 and stablelm pipelines do not support fail at load, naming field and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from pluginfer import LLM
from tests.checkpoints import assert_config_rejected, save_family_checkpoints

# The shape test_families.py uses (not imported: that module collects every family's case module).
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)

ARCHITECTURES = {"qwen2": ("Qwen2ForCausalLM", {}), "qwen3": ("Qwen3ForCausalLM", {"head_dim": 16}),
                 "glm4": ("Glm4ForCausalLM", {"head_dim": 16}), "stablelm": ("StableLmForCausalLM", {})}

# (family, config.json changes, error pattern naming the field and its value)
CASES = {
    "qwen2-longrope": ("qwen2", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0,
                                                  "original_max_position_embeddings": 64}},
                       r"rope_scaling\.rope_type.*'longrope'"),  # (yarn is supported: tests/models/test_yarn_rope.py)
    "qwen2-sliding-window-without-size": ("qwen2", {"use_sliding_window": True, "sliding_window": None},
                                          r"sliding_window.*None"),
    "qwen3-unknown-layer-type": ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]},
                                 r"layer_types.*'chunked_attention'"),
    "qwen3-layer-types-length": ("qwen3", {"layer_types": ["full_attention"]}, r"layer_types.*1 entries.*2 layers"),
    "qwen2-gelu": ("qwen2", {"hidden_act": "gelu"}, r"hidden_act.*'gelu'"),
    "glm4-gelu": ("glm4", {"hidden_act": "gelu"}, r"hidden_act.*'gelu'"),
    "glm4-dynamic-yarn": ("glm4", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                                       "partial_rotary_factor": 0.5}},
                          r"rope_scaling\.rope_type.*'yarn'"),
    "stablelm-partial-rotary-above-one": ("stablelm", {"partial_rotary_factor": 1.5},
                                          r"partial_rotary_factor.*1\.5"),
    "stablelm-relu": ("stablelm", {"hidden_act": "relu"}, r"hidden_act.*'relu'"),
    "stablelm-kv-heads": ("stablelm", {"num_key_value_heads": 3}, r"num_key_value_heads 3"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    return save_family_checkpoints(tmp_path_factory.mktemp("families"), tiny_tokenizer_dir, ARCHITECTURES, BASE)


@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_config_fails_at_load_naming_field_and_value(checkpoints: dict[str, Path], tmp_path: Path,
                                                                 case: str) -> None:
    family, changes, pattern = CASES[case]
    assert_config_rejected(checkpoints[family], tmp_path / case, changes, pattern)


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_the_unchanged_checkpoints_load(checkpoints: dict[str, Path], family: str) -> None:
    """Guards the cases above: each fails because of its change, not because the base cannot load."""
    LLM(model=str(checkpoints[family]), dtype="float32", num_blocks=16, block_size=8)
