"""The ``marlin`` quant method: configs it refuses, checkpoints already in Marlin layout, GPTQ repacked.

A Marlin checkpoint is built here from a tiny llama by round-to-nearest 4-bit (sym, group 128);
its oracle is the dense checkpoint of the same dequantized weights, ``(code - 8) * scale`` in
plain torch, loaded unquantized. The layout itself is proven against GPTQModel in
test_marlin_layout.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pluginfer import LLM
from pluginfer.quant import marlin_layout as layout
from pluginfer.quant.marlin import build
from tests.checkpoints import greedy, prefill_logits, random_prompts, save_hf_model

# head_dim 32 with 2 KV heads: k_proj/v_proj have 64 outputs, one Marlin run; hidden 128: one group.
MARLIN_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5)
GROUP = 128


def load(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, **kwargs)


def quantize_rtn(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit round-to-nearest of a ``[out, in]`` weight: (codes ``[in, out]``, fp16 scales)."""
    columns = weight.t().float()
    groups = columns.reshape(-1, group_size if group_size != -1 else columns.shape[0], columns.shape[1])
    scales = (groups.abs().amax(dim=1) / 7).clamp(min=1e-6).half()
    codes = torch.round(groups / scales.float()[:, None, :]).clamp(-8, 7).to(torch.int32) + 8
    return codes.reshape(columns.shape), scales


@pytest.fixture(scope="module")
def marlin_checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> tuple[Path, Path]:
    """(Marlin checkpoint with ``B``/``s`` tensors, dense checkpoint of the same dequantized weights)."""
    root = tmp_path_factory.mktemp("marlin")
    dense_dir, marlin_dir = root / "dense", root / "marlin"
    save_hf_model("LlamaForCausalLM", MARLIN_LLAMA, dense_dir, tiny_tokenizer_dir)
    marlin_dir.mkdir()
    for item in dense_dir.iterdir():
        if item.name != "model.safetensors":
            (marlin_dir / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(dense_dir / "model.safetensors"))
    dense, packed = {}, {}
    for name, tensor in tensors.items():
        if not name.endswith("proj.weight"):
            dense[name] = packed[name] = tensor
            continue
        codes, scales = quantize_rtn(tensor, GROUP)
        rows = tensor.shape[1] if GROUP == -1 else GROUP
        dense[name] = ((codes - 8).float() * scales.float().repeat_interleave(rows, dim=0)).t().contiguous()
        prefix = name.removesuffix("weight")
        packed[prefix + "B"], packed[prefix + "s"] = layout.pack(codes, scales, GROUP)
    save_file(dense, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, str(marlin_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((marlin_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "checkpoint_format": "marlin", "bits": 4,
                                     "group_size": GROUP, "sym": True, "desc_act": False}
    (marlin_dir / "config.json").write_text(json.dumps(config))
    return marlin_dir, dense_dir


def test_marlin_checkpoint_computes_its_dequantized_weights(marlin_checkpoints):
    marlin_dir, dense_dir = marlin_checkpoints
    llm, dense = load(marlin_dir, quant="marlin"), load(dense_dir)
    layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "quant_method")]
    assert layers and all(m.B.dtype == torch.int32 and not hasattr(m, "weight") for m in layers)
    prompt = random_prompts(200, [40], seed=5)[0]
    torch.testing.assert_close(prefill_logits(llm, prompt), prefill_logits(dense, prompt), atol=1e-4, rtol=1e-4)
    prompts = random_prompts(200, [7, 19], seed=6)
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8))]
            == [o.outputs[0].token_ids for o in dense.generate(prompts, greedy(8))])


@pytest.mark.parametrize("quantization_config", [
    None,  # as written above: GPTQ with checkpoint_format marlin
    {"quant_method": "gptq", "is_marlin_format": True, "bits": 4, "group_size": GROUP},  # AutoGPTQ
    {"quant_method": "marlin", "group_size": GROUP},  # vLLM / neuralmagic
])
def test_auto_picks_marlin_for_a_marlin_checkpoint(marlin_checkpoints, quantization_config, tmp_path):
    import shutil

    path = marlin_checkpoints[0]
    if quantization_config is not None:
        path = Path(shutil.copytree(path, tmp_path / "marlin"))
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (path / "config.json").write_text(json.dumps(config))
    llm = load(path)
    assert llm.engine.executor.quant.name == "marlin"
    prompt = random_prompts(200, [12], seed=8)[0]
    torch.testing.assert_close(prefill_logits(llm, prompt), prefill_logits(load(marlin_checkpoints[1]), prompt),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True}, "bits: 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True}, "group size: 64"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, "asym"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32, "sym": False}, "bits: 3.*group size: 32.*asym"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin", "bits": 4, "group_size": 128, "sym": False}, "asym"),
    ({"quant_method": "fp8"}, "not quant_method 'fp8'"),
])
def test_incompatible_configs_name_the_condition(config, message):
    with pytest.raises(ValueError, match=message):
        build(config)


def test_unquantized_checkpoint_is_refused():
    with pytest.raises(ValueError, match="not quantized"):
        build(None)


# GPTQModel 7.6.0 checkpoints (tests/quant/fixtures/make_gptq_awq.py): the gptq/awq quant methods
# are the oracle for the repacked layers; both dequantize to float32 as (q - zero) * scale.
FIXTURES = Path(__file__).parent / "fixtures" / "gptq_awq"
COMPATIBLE = ["gptq_b4_g128_sym", "awq_b4_g128"]
INCOMPATIBLE = {
    "gptq_b4_g32_act_asym": "group size: 32.*asym",
    "gptq_b4_gall_asym": "asym",
    "gptq_b4_g64_act_sym": "group size: 64",
    "gptq_b8_g32_asym": "bits: 8.*group size: 32.*asym",
    "gptq_b8_gall_act_sym": "bits: 8",
    "awq_b4_g32": "group size: 32",
}


def fixture(name: str) -> Path:
    path = FIXTURES / name
    if not (path / "config.json").is_file():
        pytest.skip(f"GPTQModel fixture {name} is not in {FIXTURES} (make_gptq_awq.py writes it)")
    return path


def copy_fixture(name: str, out: Path) -> Path:
    """The checkpoint and the ``base`` it shares tensors with (its index points at ``../base``)."""
    import shutil

    shutil.copytree(fixture("base"), out / "base")
    shutil.copytree(fixture(name), out / name)
    return out / name


@pytest.mark.parametrize("name", COMPATIBLE)
def test_repacked_checkpoint_equals_its_own_quant_method(name):
    path = fixture(name)
    marlin, reference = load(path, quant="marlin"), load(path)
    assert reference.engine.executor.quant.name == name.split("_")[0]
    layers = [m for m in marlin.engine.executor.pipeline.modules() if hasattr(m, "quant_method")]
    assert layers and all(hasattr(m, "B") and not hasattr(m, "qweight") for m in layers)
    assert all(hasattr(m, "z") == name.startswith("awq") for m in layers)
    prompt = random_prompts(500, [30], seed=1)[0]
    torch.testing.assert_close(prefill_logits(marlin, prompt), prefill_logits(reference, prompt),
                               atol=1e-5, rtol=1e-5)
    prompts = random_prompts(500, [5, 17], seed=2)
    assert ([o.outputs[0].token_ids for o in marlin.generate(prompts, greedy(8))]
            == [o.outputs[0].token_ids for o in reference.generate(prompts, greedy(8))])


@pytest.mark.parametrize("name", list(INCOMPATIBLE))
def test_incompatible_checkpoint_names_the_condition(name):
    with pytest.raises(ValueError, match=INCOMPATIBLE[name]):
        load(fixture(name), quant="marlin")


def _set_desc_act(path: Path) -> None:
    for config_name in ("config.json", "quantize_config.json"):
        config = json.loads((path / config_name).read_text())
        (config.get("quantization_config") or config)["desc_act"] = True
        (path / config_name).write_text(json.dumps(config))


def test_act_order_with_unsorted_g_idx_is_refused(tmp_path):
    path = copy_fixture("gptq_b4_g128_sym", tmp_path)
    _set_desc_act(path)
    name = "model.layers.0.mlp.down_proj.g_idx"
    shard = path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name][torch.randperm(tensors[name].numel(), generator=torch.Generator().manual_seed(0))]
    save_file(tensors, str(shard))
    load(path)  # a valid act-order checkpoint for the gptq method
    with pytest.raises(ValueError, match="act-order.*down_proj.*not sorted"):
        load(path, quant="marlin")


def test_act_order_with_sorted_g_idx_is_accepted(tmp_path):
    path = copy_fixture("gptq_b4_g128_sym", tmp_path)
    _set_desc_act(path)
    prompt = random_prompts(500, [20], seed=4)[0]
    torch.testing.assert_close(prefill_logits(load(path, quant="marlin"), prompt), prefill_logits(load(path), prompt),
                               atol=1e-5, rtol=1e-5)
