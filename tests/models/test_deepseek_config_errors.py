"""DeepSeek checkpoints the pipeline cannot serve fail at load, naming the field or the tensor."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pluginfer import LLM
from tests.checkpoints import assert_config_rejected, save_family_checkpoints

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.2, num_experts_per_tok=2,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
            first_k_dense_replace=1)

ARCHITECTURES = {"v2": ("DeepseekV2ForCausalLM", {"q_lora_rank": 24, "n_routed_experts": 8, "n_group": 4,
                                                  "topk_group": 2, "topk_method": "group_limited_greedy"}),
                 "v3": ("DeepseekV3ForCausalLM", {"q_lora_rank": None, "n_routed_experts": 8, "n_group": 2,
                                                  "topk_group": 1})}

# (family, config.json changes, error pattern naming the field and its value)
CASES = {
    "v2-noaux-tc": ("v2", {"topk_method": "noaux_tc"}, r"topk_method = 'noaux_tc'"),
    "v2-sigmoid-scoring": ("v2", {"scoring_func": "sigmoid"}, r"scoring_func = 'sigmoid'"),
    "v2-groups-do-not-divide": ("v2", {"n_group": 3}, r"n_group = 3"),
    "v2-more-groups-kept-than-exist": ("v2", {"topk_group": 5}, r"topk_group = 5"),
    "v2-mlp-bias": ("v2", {"mlp_bias": True}, r"mlp_bias = True"),
    "v2-grouped-kv-heads": ("v2", {"num_key_value_heads": 2}, r"num_key_value_heads = 2"),
    "v2-qwen2-moe-shared-expert": ("v2", {"shared_expert_intermediate_size": 64},
                                   r"shared_expert_intermediate_size = 64"),
    "v3-softmax-scoring": ("v3", {"scoring_func": "softmax"}, r"scoring_func = 'softmax'"),
    "v3-group-limited-greedy": ("v3", {"topk_method": "group_limited_greedy"}, r"topk_method = 'group_limited_greedy'"),
    "v3-negative-routed-scaling": ("v3", {"routed_scaling_factor": -2.5}, r"routed_scaling_factor = -2\.5"),
    "v3-dynamic-rope": ("v3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
                        r"rope_scaling\.rope_type.*'dynamic'"),
    "v3-gelu": ("v3", {"hidden_act": "gelu"}, r"hidden_act.*'gelu'"),
    "v3-no-moe-intermediate-size": ("v3", {"moe_intermediate_size": 0}, r"moe_intermediate_size.*0"),
}

# (family, checkpoint tensor removed)
MISSING = {"v2-routed-expert": ("v2", "model.layers.1.mlp.experts.3.down_proj.weight"),
           "v2-shared-expert": ("v2", "model.layers.2.mlp.shared_experts.up_proj.weight"),
           "v2-latent-up-projection": ("v2", "model.layers.0.self_attn.kv_b_proj.weight"),
           "v3-routed-expert": ("v3", "model.layers.2.mlp.experts.7.gate_proj.weight"),
           "v3-correction-bias": ("v3", "model.layers.1.mlp.gate.e_score_correction_bias")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    return save_family_checkpoints(tmp_path_factory.mktemp("deepseek"), tiny_tokenizer_dir, ARCHITECTURES, BASE)


@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_config_fails_at_load_naming_field_and_value(checkpoints: dict[str, Path], tmp_path: Path,
                                                                 case: str) -> None:
    family, changes, pattern = CASES[case]
    assert_config_rejected(checkpoints[family], tmp_path / case, changes, pattern)


@pytest.mark.parametrize("case", list(MISSING))
def test_missing_tensor_fails_at_load_naming_it(checkpoints: dict[str, Path], tmp_path: Path, case: str) -> None:
    family, tensor = MISSING[case]
    path = tmp_path / case
    shutil.copytree(checkpoints[family], path)
    tensors = load_file(path / "model.safetensors")
    del tensors[tensor]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=tensor.replace(".", r"\.")):
        LLM(model=str(path), dtype="float32", num_blocks=16, block_size=8)


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_the_unchanged_checkpoints_load(checkpoints: dict[str, Path], family: str) -> None:
    """Guards the cases above: each fails because of its change, not because the base cannot load."""
    LLM(model=str(checkpoints[family]), dtype="float32", num_blocks=16, block_size=8)


def test_multi_token_prediction_layers_are_skipped(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """DeepSeek-V3 checkpoints carry their MTP layer as model.layers.{num_hidden_layers}: not served, not an error."""
    import torch

    path = tmp_path / "mtp"
    shutil.copytree(checkpoints["v3"], path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    LLM(model=str(path), dtype="float32", num_blocks=16, block_size=8)
