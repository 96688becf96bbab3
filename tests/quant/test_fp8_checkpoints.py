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
    """(float8 e4m3 levels, float32 scale per block) as DeepSeek's weight quantization writes them: a block at a
    ragged edge is the part of it the weight has."""
    rows, cols = weight.shape
    levels = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // block), -(-cols // block))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = part.abs().max() / 448 if part.abs().max() > 0 else 1.0
            levels[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scale[i, j]).clamp(-448, 448).to(
                torch.float8_e4m3fn)
    return levels, scale


def dequantize_blocks(levels: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty(levels.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            cut = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            out[cut] = levels[cut].float() * scale[i, j]
    return out


def save_fp8_checkpoint(source: Path, out: Path, block: int = BLOCK, dequantized: Path | None = None) -> Path:
    """``source``'s linear projections (experts' too) as float8 blocks with ``weight_scale_inv``; the rest as it
    is. ``dequantized``: where to write the same checkpoint with those weights dequantized back to float32."""
    shutil.copytree(source, out)
    tensors, plain = {}, {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        plain[name] = tensors[name] = tensor
        if tensor.dim() == 2 and name.endswith(".weight") and "proj" in name.split(".")[-2]:  # kv_a_proj_with_mqa too
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensor, block)
            plain[name] = dequantize_blocks(tensors[name], tensors[name + "_scale_inv"], block)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((out / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(hf_config))
    if dequantized is not None:
        shutil.copytree(source, dequantized)
        save_file(plain, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
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


@pytest.mark.parametrize("case", ["qwen3-moe", "deepseek-v3"])
def test_mixture_of_experts_and_latent_attention_match_transformers(case: str, tmp_path: Path,
                                                                    tiny_tokenizer_dir: Path) -> None:
    """A Qwen3-MoE whose routed experts are float8 blocks too (as Qwen3-30B-A3B-FP8's), and a DeepSeek-V3 (latent
    attention's q_a/q_b/kv_a/kv_b projections, shared and routed experts, YaRN) in blocks of 8: each weight with
    its scales reaches its layer dense; logits within 1e-4 of transformers' CPU dequantization."""
    import transformers

    from tests.models.family_cases_deepseek import CASES

    if case == "qwen3-moe":
        arch, shape, block = "Qwen3MoeForCausalLM", {**SHAPE, "moe_intermediate_size": 128, "num_experts": 4,
                                                     "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                                                     "head_dim": 32}, BLOCK
    else:
        arch, overrides = CASES["deepseek-v3-yarn"][:2]
        shape, block = {**TINY_LLAMA, **overrides}, 8  # its projections are 24-128 wide
    save_hf_model(arch, shape, tmp_path / "float", tiny_tokenizer_dir)
    path = save_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", block=block)
    stored = load_file(str(path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in stored
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = random_prompts(200, [24], seed=3)[0]
    with load(path) as llm:
        torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_ragged_blocks_equal_the_dequantized_checkpoint(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Blocks of 48 over 64, 128 and 256 (DeepSeek-V3's 576-row kv_a_proj ends in a part-block the same way):
    the model loaded from the float8 blocks equals, bit for bit, the one loaded from the weights dequantized
    block by block here."""
    save_hf_model("LlamaForCausalLM", SHAPE, tmp_path / "float", tiny_tokenizer_dir)
    path = save_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", block=48, dequantized=tmp_path / "plain")
    assert load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (2, 3)
    prompt = random_prompts(200, [24], seed=3)[0]
    with load(path) as llm:
        blocks = prefill_logits(llm, prompt)
    with load(tmp_path / "plain") as llm:
        assert torch.equal(blocks, prefill_logits(llm, prompt))


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


def test_float_weights_and_scales_that_do_not_fit_are_named(fp8_checkpoints: dict[str, Path],
                                                           tmp_path: Path) -> None:
    def edited(name: str, change) -> Path:
        path = shutil.copytree(fp8_checkpoints["llama"], tmp_path / name)
        tensors = load_file(str(path / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path

    up = "model.layers.0.mlp.up_proj.weight"
    floats = edited("floats", lambda t: t.update({up: t[up].float()}))
    with pytest.raises(ValueError, match=r"up_proj\.weight_scale_inv: .*up_proj\.weight is torch\.float32, not the "
                                         r"float8_e4m3fn levels it scales"):
        load(floats)
    grid = edited("grid", lambda t: t.update({up + "_scale_inv": t[up + "_scale_inv"][:, :1].contiguous()}))
    with pytest.raises(ValueError, match=r"up_proj\.weight_scale_inv: shape \(4, 1\), where .*up_proj\.weight "
                                         r"\(256, 128\) in blocks of \[64, 64\] .* needs \(4, 2\)"):
        load(grid)
    lonely = edited("lonely", lambda t: t.pop(up + "_scale_inv"))
    with pytest.raises(KeyError, match=r"up_proj\.weight \(no .*up_proj\.weight_scale_inv\)"):
        load(lonely)
