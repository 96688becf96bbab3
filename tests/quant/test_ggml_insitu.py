"""The in-situ GGML quant methods: the bytes they keep, their matmul, and a tiny llama quantized at load.

The oracles: gguf-py quantizes the legacy types to the same bytes (and dequantizes every type);
Q4_K and Q6_K bytes come from ``ggml_quantize.quantize``, which test_ggml_blocks.py proves equal
to llama.cpp's C library.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from pluginfer import LLM
from pluginfer.quant import ggml_blocks, ggml_insitu, ggml_quantize
from tests.checkpoints import greedy, prefill_logits, random_prompts, save_hf_model
from tests.quant.helpers import build_layer, load_and_quantize

QTYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
          "q4_1": GGMLQuantizationType.Q4_1, "q5_0": GGMLQuantizationType.Q5_0,
          "q5_1": GGMLQuantizationType.Q5_1, "q4_k": GGMLQuantizationType.Q4_K,
          "q6_k": GGMLQuantizationType.Q6_K}
GGUF_PY_QUANTIZES = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1"}


def expected_bytes(weight: torch.Tensor, method: str) -> np.ndarray:
    qtype = QTYPES[method]
    if method in GGUF_PY_QUANTIZES:
        return gguf_quants.quantize(weight.float().numpy(), qtype)
    return ggml_quantize.quantize(weight, qtype).numpy()


def dequantized(raw: np.ndarray, method: str) -> torch.Tensor:
    """GGML bytes dequantized by gguf-py."""
    return torch.from_numpy(gguf_quants.dequantize(raw, QTYPES[method]))


def resident_bytes_per_weight(layers: list[torch.nn.Module]) -> float:
    nbytes = sum(p.nbytes for m in layers for name, p in m.named_parameters(recurse=False) if name != "bias")
    return nbytes / sum(m.input_size * m.output_size for m in layers)


@pytest.mark.parametrize("method", list(QTYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_keeps_ggml_bytes_and_matches_the_dequantized_matmul(method: str, dtype: torch.dtype) -> None:
    # 520 outputs: two tiles of rows, the second one partial (K-quants: fewer rows, as quantizing
    # them is slow; test_ggml_blocks.py tiles them).
    rows = 136 if method in ("q4_k", "q6_k") else 520
    generator = torch.Generator().manual_seed(len(method))
    weight, bias = torch.randn(rows, 256, generator=generator) * 0.1, torch.randn(rows, generator=generator)
    weight[0, :32] = 0  # an all-zero block
    weight = weight.to(dtype)
    layer = build_layer(method, input_size=256, output_size=rows, bias=True, dtype=dtype)
    load_and_quantize(layer, weight, "model.layers.0.mlp.up_proj.weight", bias.to(dtype))

    assert set(dict(layer.named_parameters())) == {"qweight", "bias"}
    block, type_size = GGML_QUANT_SIZES[QTYPES[method]]
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (rows, 256 // block * type_size)
    expected_raw = expected_bytes(weight, method)
    np.testing.assert_array_equal(layer.qweight.numpy(), expected_raw)
    assert resident_bytes_per_weight([layer]) == type_size / block

    x = torch.randn(3, 5, 256, generator=generator).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (3, 5, rows)
    # With the cpu backend's fused kernel (AVX2 / AVX-512 VNNI) these 15 rows multiply int8 activations:
    # the oracle multiplies the same rounded activations (ggml_blocks.quantize_activations).
    inputs = x.float()
    if getattr(layer.ggml_dequantize, "quant_matmul", None) is not None:
        levels, scales = ggml_blocks.quantize_activations(inputs)
        inputs = (levels.float().unflatten(-1, (-1, 32)) * scales[..., None]).flatten(-2)
    expected = F.linear(inputs, dequantized(expected_raw, method), bias.to(dtype).float())
    # float32: the same products summed in another order. bfloat16: each tile is rounded to
    # bfloat16 before the matmul, like any bfloat16 weight.
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(out.float(), expected, **tolerance)


def test_q8_0_error_against_the_original_weight_is_half_a_step() -> None:
    weight, bias = torch.randn(1100, 128) * 0.1, torch.randn(1100)
    layer = build_layer("q8_0", input_size=128, output_size=1100, bias=True)
    load_and_quantize(layer, weight, "w", bias)
    x = torch.randn(3, 5, 128)
    # Each weight is off by at most d / 2 = max|block| / 254 (plus d's rounding to fp16).
    error_bound = x.abs() @ (weight.abs().amax(dim=1) / 254 + 1e-6)[None, :].expand(128, -1)
    assert ((layer(x) - F.linear(x, weight, bias)).abs() <= error_bound).all()


@pytest.mark.parametrize(("method", "input_size"), [("q8_0", 40), ("q5_1", 48), ("q4_k", 288), ("q6_k", 128)])
def test_input_size_not_a_multiple_of_the_block_names_the_tensor_and_shape(method: str, input_size: int) -> None:
    layer = build_layer(method, input_size=input_size, output_size=8)
    block = GGML_QUANT_SIZES[QTYPES[method]][0]
    with pytest.raises(ValueError, match=rf"'model\.layers\.1\.self_attn\.o_proj\.weight'.*\(8, {input_size}\).*"
                                         rf"multiple of {block}"):
        load_and_quantize(layer, torch.randn(8, input_size), "model.layers.1.self_attn.o_proj.weight")


@pytest.mark.parametrize("method", list(QTYPES))
def test_factories_refuse_an_already_quantized_checkpoint(method: str) -> None:
    factory = getattr(ggml_insitu, f"build_{method}")
    assert factory(None).name == method
    with pytest.raises(ValueError, match=rf"'{method}'.*already quantized \(gptq\)"):
        factory({"quant_method": "gptq", "bits": 4})


# A llama whose every linear input size (hidden 256, heads 4 x 64, intermediate 256) is a
# multiple of the K-quants' 256; initializer_range 0.05 keeps its attention softer than the
# session's tiny llama (0.2), so 4-bit rounding moves logits by a few percent, not more.
K_LLAMA = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05, rms_norm_eps=1e-5)
# Worst per-position KL divergence from the fp32 logits allowed for each method: about twice what
# was measured on this model and prompt (q6_k 0.0008, q4_k 0.013, q4_0 0.018; top-1 agreement
# 93%, 62%, 70%: this random model's logits are nearly flat, std 0.8, so ties flip easily).
MODEL_METHODS = {"q6_k": 0.002, "q4_k": 0.03, "q4_0": 0.04}


@pytest.fixture(scope="module")
def k_llama(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("k_llama")
    save_hf_model("LlamaForCausalLM", K_LLAMA, out, tiny_tokenizer_dir)
    return out


def load(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, **kwargs)


@pytest.fixture(scope="module")
def prompt_and_fp32_logits(k_llama: Path) -> tuple[list[int], torch.Tensor]:
    prompt = random_prompts(200, [40], seed=5)[0]
    return prompt, prefill_logits(load(k_llama), prompt)


def dequantized_checkpoint(source: Path, out: Path, method: str) -> Path:
    """The checkpoint with each linear weight replaced by its quantized-then-dequantized self."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            tensors[name] = dequantized(expected_bytes(tensor, method), method)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("method", list(MODEL_METHODS))
def test_llama_quantized_at_load_computes_with_its_dequantized_weights(
        method: str, k_llama: Path, prompt_and_fp32_logits: tuple[list[int], torch.Tensor], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Float32 activations against dequantized tiles: the claim is that the drift is the weights' rounding
    # alone (1e-4). The cpu backend's fused int8-activation matmul (x86 CPUs with AVX2, up to
    # ggml_blocks.QUANT_MATMUL_MAX_ROWS tokens) adds the activations' rounding, ~0.5 % per linear;
    # tests/backends/test_native_quant_dot.py holds it to this path.
    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")
    llm = load(k_llama, quant=method)
    layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "quant_method")]
    assert layers and all(set(dict(m.named_parameters(recurse=False))) <= {"qweight", "bias"} for m in layers)
    block, type_size = GGML_QUANT_SIZES[QTYPES[method]]
    assert resident_bytes_per_weight(layers) == type_size / block
    assert resident_bytes_per_weight(layers) <= (0.6 if method == "q4_k" else 1.1)

    prompt, reference = prompt_and_fp32_logits
    logits = prefill_logits(llm, prompt)
    # Exactly the model of the dequantized weights (gguf-py dequantizes): the drift is rounding alone.
    dense = load(dequantized_checkpoint(k_llama, tmp_path / method, method))
    torch.testing.assert_close(logits, prefill_logits(dense, prompt), atol=1e-4, rtol=1e-4)
    # And close to fp32 (bounds and measurements at MODEL_METHODS).
    reference_logprobs, logprobs = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (reference_logprobs.exp() * (reference_logprobs - logprobs)).sum(-1).max().item()
    assert kl < MODEL_METHODS[method], f"{method}: worst per-position KL divergence {kl:.4f}"

    out = llm.generate([prompt], greedy(6))[0]
    assert len(out.outputs[0].token_ids) == 6
