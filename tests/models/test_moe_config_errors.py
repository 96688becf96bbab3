"""MoE checkpoints the mixtral, qwen2-moe and qwen3-moe pipelines cannot serve fail at load, naming the field or
tensor."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pluginfer import LLM
from tests.checkpoints import assert_config_rejected, save_family_checkpoints

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, num_experts_per_tok=2)

ARCHITECTURES = {"mixtral": ("MixtralForCausalLM", {"num_local_experts": 4}),
                 "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32,
                                                       "head_dim": 16}),
                 "qwen2-moe": ("Qwen2MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32,
                                                       "shared_expert_intermediate_size": 64})}

# (family, config.json changes, error pattern naming the field and its value)
CASES = {
    "mixtral-sigmoid-scoring": ("mixtral", {"scoring_func": "sigmoid"}, r"scoring_func.*'sigmoid'"),
    "mixtral-top-k-above-experts": ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok.*5"),
    "mixtral-no-experts": ("mixtral", {"num_local_experts": 0}, r"num_local_experts.*0"),
    "qwen3-moe-grouped-top-k": ("qwen3-moe", {"n_group": 2, "topk_group": 1}, r"n_group.*2"),
    "qwen3-moe-shared-experts": ("qwen3-moe", {"shared_expert_intermediate_size": 64},
                                 r"shared_expert_intermediate_size.*64"),
    "qwen3-moe-routed-scaling": ("qwen3-moe", {"routed_scaling_factor": 2.5}, r"routed_scaling_factor.*2\.5"),
    "qwen3-moe-sparse-step-zero": ("qwen3-moe", {"decoder_sparse_step": 0}, r"decoder_sparse_step.*0"),
    "qwen3-moe-gelu": ("qwen3-moe", {"hidden_act": "gelu"}, r"hidden_act.*'gelu'"),
    "qwen2-moe-sliding-window": ("qwen2-moe", {"use_sliding_window": True}, r"use_sliding_window = true"),
    "qwen2-moe-no-shared-expert-size": ("qwen2-moe", {"shared_expert_intermediate_size": 0},
                                        r"shared_expert_intermediate_size.*0"),
    "qwen2-moe-grouped-top-k": ("qwen2-moe", {"n_group": 2, "topk_group": 1}, r"n_group.*2"),
}

# (family, checkpoint tensor removed)
MISSING = {"mixtral": "model.layers.1.block_sparse_moe.experts.3.w2.weight",
           "qwen3-moe": "model.layers.0.mlp.experts.2.up_proj.weight",
           "qwen2-moe": "model.layers.1.mlp.shared_expert_gate.weight"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    return save_family_checkpoints(tmp_path_factory.mktemp("families"), tiny_tokenizer_dir, ARCHITECTURES, BASE)


@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_config_fails_at_load_naming_field_and_value(checkpoints: dict[str, Path], tmp_path: Path,
                                                                 case: str) -> None:
    family, changes, pattern = CASES[case]
    assert_config_rejected(checkpoints[family], tmp_path / case, changes, pattern)


@pytest.mark.parametrize("family", list(MISSING))
def test_missing_expert_tensor_fails_at_load_naming_it(checkpoints: dict[str, Path], tmp_path: Path,
                                                       family: str) -> None:
    path = tmp_path / family
    shutil.copytree(checkpoints[family], path)
    tensors = load_file(path / "model.safetensors")
    del tensors[MISSING[family]]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=MISSING[family].replace(".", r"\.")):
        LLM(model=str(path), dtype="float32", num_blocks=16, block_size=8)


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_the_unchanged_checkpoints_load(checkpoints: dict[str, Path], family: str) -> None:
    """Guards the cases above: each fails because of its change, not because the base cannot load."""
    LLM(model=str(checkpoints[family]), dtype="float32", num_blocks=16, block_size=8)
