"""YaRN rope scaling (``rope_type: yarn``) for llama, mistral, qwen2, qwen3 and qwen3-moe: our logits and greedy tokens equal
transformers' for the same config.json, past the original context; the GGUF file ``pluginfer convert`` writes
carries it; what GGUF cannot carry is refused.

Two config styles: Qwen2.5's long-context hub config (``rope_scaling: {"type": "yarn", "factor": 4.0,
"original_max_position_embeddings": ...}`` beside ``rope_theta``, max_position_embeddings the original length),
and transformers 5's ``rope_parameters`` with every yarn knob set (beta_fast, beta_slow, truncate, attention_factor).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pluginfer import LLM
from pluginfer.cli import main
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts, save_hf_model

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2, rms_norm_eps=1e-5)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", {}), "mistral": ("MistralForCausalLM", {}),
                 "qwen2": ("Qwen2ForCausalLM", {}), "qwen3": ("Qwen3ForCausalLM", {"head_dim": 16}),
                 "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                       "moe_intermediate_size": 64, "head_dim": 16})}
ORIGINAL = 64  # the "pretraining" context; prompts run past it
STYLES = {
    # Qwen2.5-7B-Instruct's README config, scaled down: max_position_embeddings is the original context.
    "qwen2.5-hub": {"max_position_embeddings": ORIGINAL, "rope_theta": 10000.0,
                    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}},
    "rope-parameters": {"max_position_embeddings": 4 * ORIGINAL, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False, "attention_factor": 1.25}},
}
PROMPT_LENGTHS = [200, 70, 9]  # beyond, just past and within the original context
NEW_TOKENS = 24


def write_yarn_checkpoint(source: Path, target: Path, style: str) -> Path:
    """``source`` (a default-rope checkpoint: the weights do not depend on rope) with a yarn config.json."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings"):
        config.pop(key, None)
    config.update(STYLES[style])
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def default_rope_checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("yarn")
    paths = {}
    for family, (arch, overrides) in ARCHITECTURES.items():
        paths[family] = root / family
        save_hf_model(arch, {**BASE, **overrides, "max_position_embeddings": 4 * ORIGINAL}, paths[family],
                      tiny_tokenizer_dir)
    return paths


def transformers_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "yarn" and rotary.attention_scaling != 1.0, "transformers did not read the yarn config"
    return model


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_yarn_logits_and_greedy_tokens_equal_transformers(family: str, style: str, tmp_path: Path,
                                                          default_rope_checkpoints: dict[str, Path]) -> None:
    path = write_yarn_checkpoint(default_rope_checkpoints[family], tmp_path / family, style)
    theirs = transformers_model(path)
    ours = LLM(model=str(path), dtype="float32", num_blocks=128, block_size=8)
    assert ours.engine.max_model_len == 4 * ORIGINAL  # the original context times the factor, as vLLM
    prompts = random_prompts(theirs.config.vocab_size, PROMPT_LENGTHS, seed=3)
    for prompt in prompts:
        torch.testing.assert_close(prefill_logits(ours, prompt), hf_logits(theirs, prompt), atol=1e-4, rtol=1e-4)
    outputs = ours.generate(prompts, greedy(NEW_TOKENS))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(theirs, prompt, NEW_TOKENS)


def test_yarn_is_not_the_default_rope(default_rope_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The comparison above has teeth: with yarn the logits past the original context differ from default rope."""
    plain = LLM(model=str(default_rope_checkpoints["qwen2"]), dtype="float32", num_blocks=64, block_size=8)
    path = write_yarn_checkpoint(default_rope_checkpoints["qwen2"], tmp_path / "qwen2", "qwen2.5-hub")
    yarn = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8)
    prompt = random_prompts(1000, [150], seed=4)[0]
    assert (prefill_logits(plain, prompt) - prefill_logits(yarn, prompt)).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_converted_gguf_carries_yarn(family: str, default_rope_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """convert writes rope.scaling.{type,factor,original_context_length}; the file, read back, computes the logits
    transformers computes from the Hugging Face checkpoint."""
    import gguf

    path = write_yarn_checkpoint(default_rope_checkpoints[family], tmp_path / family, "qwen2.5-hub")
    out = tmp_path / f"{family}.gguf"
    assert main(["convert", "--model", str(path), "--quant", "f32", "--embedding-type", "f32",
                 "--output", str(out), "--no-progress"]) == 0
    reader = gguf.GGUFReader(out)
    arch = reader.get_field("general.architecture").contents()
    assert reader.get_field(f"{arch}.rope.scaling.type").contents() == "yarn"
    assert reader.get_field(f"{arch}.rope.scaling.factor").contents() == 4.0
    assert reader.get_field(f"{arch}.rope.scaling.original_context_length").contents() == ORIGINAL

    theirs = transformers_model(path)
    ours = LLM(model=str(out), dtype="float32", num_blocks=128, block_size=8)
    assert ours.engine.max_model_len == 4 * ORIGINAL
    for prompt in random_prompts(theirs.config.vocab_size, PROMPT_LENGTHS[:2], seed=5):
        torch.testing.assert_close(prefill_logits(ours, prompt), hf_logits(theirs, prompt), atol=1e-4, rtol=1e-4)


def test_convert_refuses_yarn_knobs_gguf_cannot_carry(default_rope_checkpoints: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    path = write_yarn_checkpoint(default_rope_checkpoints["qwen2"], tmp_path / "qwen2", "rope-parameters")
    assert main(["convert", "--model", str(path), "--quant", "f32", "--output", str(tmp_path / "x.gguf"),
                 "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "rope_scaling: yarn with beta_fast=16.0, beta_slow=2.0, attention_factor=1.25, truncate=False" in error
    assert not (tmp_path / "x.gguf").exists()
