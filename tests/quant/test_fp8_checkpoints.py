"""Block-wise FP8 checkpoints (``quant_method: fp8``, as DeepSeek-V3 and Qwen3-FP8 ship) against transformers,
which dequantizes them on a CPU the same way (its fine-grained FP8 integration)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pluginfer import LLM
from pluginfer.quant import fp8
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts, save_hf_model
from tests.conftest import TINY_LLAMA

BLOCK = 64
# every projection whole blocks of 64: q 128 x 128 (2 x 2 blocks), k/v 64 x 128, gate/up 256 x 128, down 128 x 256
SHAPE = {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 256}
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # qwen2: the q/k/v biases


def quantize_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 levels, float32 scale per block) as DeepSeek's weight quantization writes them."""
    rows, cols = weight.shape
    blocks = weight.reshape(rows // block, block, cols // block, block)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    levels = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(rows, cols)
    return levels, scale.float()


def save_fp8_checkpoint(source: Path, out: Path, **config: object) -> Path:
    """``source``'s linear projections as float8 blocks with ``weight_scale_inv``; the rest as it is."""
    shutil.copytree(source, out)
    tensors = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize_blocks(tensor, BLOCK)
        else:
            tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((out / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [BLOCK, BLOCK], **config}
    (out / "config.json").write_text(json.dumps(hf_config))
    return out


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_blocks")
    paths = {}
    for family, arch in FAMILIES.items():
        save_hf_model(arch, SHAPE, root / f"{family}-float", tiny_tokenizer_dir)
        paths[family] = save_fp8_checkpoint(root / f"{family}-float", root / family)
    return paths


def load(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, **kwargs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(family: str, fp8_checkpoints: dict[str, Path]) -> None:
    """Both dequantize each block (level x its scale) to float32; the logits agree to float rounding."""
    import transformers

    path = fp8_checkpoints[family]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = random_prompts(200, [40], seed=3)[0]
    with load(path) as llm:
        layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "quant_method")]
        assert layers and {m.quant_method.name for m in layers} == {"fp8"}
        torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)
        assert llm.generate([prompt], greedy(12))[0].outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def test_dequantized_weights_are_the_blocks_times_their_scales(fp8_checkpoints: dict[str, Path]) -> None:
    """q_proj of layer 0 (2 x 2 blocks) inside the fused qkv layer: each block its levels times its own scale."""
    tensors = load_file(str(fp8_checkpoints["llama"] / "model.safetensors"))
    prefix = "model.layers.0.self_attn.q_proj."
    levels, scale = tensors[prefix + "weight"], tensors[prefix + "weight_scale_inv"]
    assert levels.dtype == torch.float8_e4m3fn and scale.shape == (2, 2)
    want = levels.float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    with load(fp8_checkpoints["llama"]) as llm:
        qkv = next(m for name, m in llm.engine.executor.pipeline.named_modules()
                   if name.endswith("0.self_attn.qkv_proj"))
        x = torch.eye(128)
        assert torch.equal(qkv(x)[:, :128], want.t())  # the identity's rows read the weight's columns back


def test_two_tensor_parallel_ranks_equal_one(fp8_checkpoints: dict[str, Path]) -> None:
    """Column-parallel ranks take their rows of every block row's scales, row-parallel ranks their input blocks."""
    prompt = random_prompts(200, [24], seed=5)[0]
    with load(fp8_checkpoints["qwen2"]) as llm:
        one = prefill_logits(llm, prompt)
    with load(fp8_checkpoints["qwen2"], tensor_parallel_size=2, timeout_s=60.0) as llm:
        two = llm.generate([prompt], greedy(1))
    assert two[0].outputs[0].token_ids == [int(one[-1].argmax())]


@pytest.mark.parametrize(("change", "message"), [
    ({"weight_block_size": None}, r"weight_block_size: None: only block-wise FP8"),
    ({"weight_block_size": [128]}, r"weight_block_size: \[128\]"),
    ({"fmt": "e5m2"}, r"quantization_config\.fmt: 'e5m2' is not supported \(supported: e4m3\)"),
    ({"activation_scheme": "static"}, r"activation_scheme: 'static' is not supported \(supported: dynamic\)"),
    ({"modules_to_not_convert": ["lm_head"]}, r"quantization_config: modules_to_not_convert not supported"),
])
def test_configs_it_does_not_serve_are_named(change: dict, message: str) -> None:
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}
    with pytest.raises(ValueError, match=message):
        fp8.build({**config, **change})


def test_blocks_that_do_not_tile_a_layer_and_float_weights_are_named(fp8_checkpoints: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    uneven = shutil.copytree(fp8_checkpoints["llama"], tmp_path / "uneven")
    config = json.loads((uneven / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 96]
    (uneven / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 96\]: a layer's 128 inputs .* are not whole "
                                         r"blocks of 96"):
        load(uneven)
    floats = shutil.copytree(fp8_checkpoints["llama"], tmp_path / "floats")
    tensors = load_file(str(floats / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].float()
    save_file(tensors, str(floats / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.*float32, not the float8_e4m3fn of an fp8 checkpoint"):
        load(floats)
