"""The ``int4`` method: its definition's error bound, the layer's storage and matmul, a tiny llama."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pluginfer import LLM
from pluginfer.quant.int4 import GROUP_SIZE, build, dequantize_int4, quantize_int4
from tests.checkpoints import greedy, prefill_logits, random_prompts, save_hf_model
from tests.quant.helpers import build_layer, load_and_quantize


def edge_case_weight(rows: int, cols: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator) * torch.rand(rows, 1, generator=generator) * 2
    weight[0] = 0                                       # all-zero row: reads back exactly 0
    weight[1, :GROUP_SIZE] = 0.3                         # a constant group: scale 0
    weight[2, :GROUP_SIZE] = weight[2, :GROUP_SIZE].abs() + 1   # all positive: the zero is above 0
    weight[3, :GROUP_SIZE] = -weight[3, :GROUP_SIZE].abs() - 1  # all negative
    weight[4, 5] = 30.0                                  # an outlier stretches its group's step
    return weight


def test_round_trip_error_is_within_the_definitions_bound() -> None:
    weight = edge_case_weight(16, 384)
    qweight, scales, zeros = quantize_int4(weight)
    assert qweight.dtype == torch.uint8 and qweight.shape == (16, 192)
    assert scales.dtype == zeros.dtype == torch.float16 and scales.shape == zeros.shape == (16, 3)
    groups = weight.reshape(16, 3, GROUP_SIZE)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    torch.testing.assert_close(zeros.float(), low, atol=0, rtol=2**-11)  # fp16 of each group's minimum
    torch.testing.assert_close(scales.float(), (high - low) / 15, atol=0, rtol=2**-11)

    restored = dequantize_int4(qweight, scales, zeros)
    # The bound stated in int4.py: half a step, plus how far fp16 rounding moved the grid's ends;
    # 1e-6 relative for the float32 arithmetic of q * scale + zero.
    bound = (scales.float() / 2 + (low - zeros.float()).abs() + 15 * ((high - low) / 15 - scales.float()).abs()
             + 1e-6 * groups.abs().amax(dim=2))
    error = (restored.reshape(16, 3, GROUP_SIZE) - groups).abs()
    assert (error <= bound.unsqueeze(-1)).all()
    assert restored[0].eq(0).all()
    assert restored[1, :GROUP_SIZE].eq(torch.tensor(0.3).half().float()).all()
    # Every level is used at the ends of a random group: the minimum maps to 0, the maximum to 15.
    levels = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(16, 3, GROUP_SIZE)
    assert levels[5:].amin(dim=2).eq(0).all() and levels[5:].amax(dim=2).eq(15).all()


def test_two_levels_per_byte_even_index_in_the_low_nibble() -> None:
    weight = torch.arange(GROUP_SIZE, dtype=torch.float32).remainder(16).reshape(1, GROUP_SIZE)  # levels 0..15
    qweight, scales, zeros = quantize_int4(weight)
    assert scales.item() == 1 and zeros.item() == 0
    assert qweight[0, :8].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_dense_linear_of_the_dequantized_weight(dtype: torch.dtype) -> None:
    weight, bias = edge_case_weight(1100, 256) * 0.1, torch.randn(1100)  # three tiles of rows, the last partial
    layer = build_layer("int4", input_size=256, output_size=1100, bias=True, dtype=dtype)
    load_and_quantize(layer, weight.to(dtype), "w", bias.to(dtype))
    params = dict(layer.named_parameters())
    assert set(params) == {"qweight", "scales", "zeros", "bias"}
    resident = sum(p.nbytes for name, p in params.items() if name != "bias") / weight.numel()
    assert resident == 0.5 + 4 / GROUP_SIZE <= 0.6

    x = torch.randn(2, 7, 256).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 7, 1100)
    expected = F.linear(x.float(), dequantize_int4(*quantize_int4(weight.to(dtype))), bias.to(dtype).float())
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(out.float(), expected, **tolerance)


def test_input_size_not_a_multiple_of_the_group_names_the_tensor() -> None:
    layer = build_layer("int4", input_size=192, output_size=8)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight'.*\(8, 192\).*multiple of 128"):
        load_and_quantize(layer, torch.randn(8, 192), "model.layers.0.mlp.down_proj.weight")


def test_factory_refuses_an_already_quantized_checkpoint() -> None:
    assert build(None).name == "int4"
    with pytest.raises(ValueError, match=r"'int4'.*already quantized \(awq\)"):
        build({"quant_method": "awq"})


# Every linear input size (hidden 256, intermediate 256) is a multiple of the 128-weight group.
INT4_LLAMA = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05, rms_norm_eps=1e-5)


def load(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, **kwargs)


def test_llama_quantized_at_load_stays_close_to_fp32(tmp_path: Path, tiny_tokenizer_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file, save_file

    # float32 tiles: the 40-token prompt would take bfloat16 ones on an AMX-BF16 CPU (docs/quantization.md,
    # "bfloat16 tiles"), whose rounding (~0.3 % per linear) the 1e-4 comparison below does not allow.
    monkeypatch.setenv("PLUGINFER_QUANT_TILES", "float32")
    source = tmp_path / "fp32"
    save_hf_model("LlamaForCausalLM", INT4_LLAMA, source, tiny_tokenizer_dir)
    prompt = random_prompts(200, [40], seed=5)[0]
    llm = load(source, quant="int4")
    layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "quant_method")]
    assert layers and all("weight" not in dict(m.named_parameters(recurse=False)) for m in layers)
    nbytes = sum(p.nbytes for m in layers for name, p in m.named_parameters(recurse=False) if name != "bias")
    assert nbytes / sum(m.input_size * m.output_size for m in layers) <= 0.6
    logits = prefill_logits(llm, prompt)

    # Exactly the model of the dequantized weights: the drift is the rounding of the weights alone.
    dense = tmp_path / "dequantized"
    shutil.copytree(source, dense)
    tensors = load_file(str(dense / "model.safetensors"))
    tensors.update({name: dequantize_int4(*quantize_int4(tensor)) for name, tensor in tensors.items()
                    if name.endswith("proj.weight")})
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})
    torch.testing.assert_close(logits, prefill_logits(load(dense), prompt), atol=1e-4, rtol=1e-4)

    # Close to fp32: measured worst per-position KL divergence 0.030 (q4_0 0.018 and q4_k 0.013 on
    # the same model and prompt: their blocks of 32 have narrower ranges, so finer steps, than
    # groups of 128); the bound is about twice that. Swapping the two nibbles of each byte gives 0.75.
    reference = prefill_logits(load(source), prompt).log_softmax(-1)
    kl = (reference.exp() * (reference - logits.log_softmax(-1))).sum(-1).max().item()
    assert kl < 0.06, f"worst per-position KL divergence {kl:.4f}"
    assert len(llm.generate([prompt], greedy(6))[0].outputs[0].token_ids) == 6
