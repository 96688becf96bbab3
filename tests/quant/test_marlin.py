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


def test_auto_picks_marlin_for_a_marlin_checkpoint(marlin_checkpoints):
    llm = load(marlin_checkpoints[0])
    assert llm.engine.executor.quant.name == "marlin"


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True}, "bits: 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True}, "group size: 64"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, "asym"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32, "sym": False}, "bits: 3.*group size: 32.*asym"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version"),
    ({"quant_method": "fp8"}, "not quant_method 'fp8'"),
])
def test_incompatible_configs_name_the_condition(config, message):
    with pytest.raises(ValueError, match=message):
        build(config)


def test_unquantized_checkpoint_is_refused():
    with pytest.raises(ValueError, match="not quantized"):
        build(None)
