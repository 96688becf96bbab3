"""GGUF files of the dense families beside llama (gemma, gemma2, gemma3, phi2, phi3, stablelm, glm4), written by
llama.cpp's own converter (fixtures/make_gguf_fixtures.py) from tiny random checkpoints: our reading of each
against transformers built from the source checkpoint's config with the file's weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pluginfer import LLM
from pluginfer.engine.loader import iter_weights, read_hf_config
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts
from tests.quant.fixtures.make_gguf_fixtures import MODELS, source_config
from tests.quant.gguf_helpers import transformers_from_source

FIXTURES = Path(__file__).parent / "fixtures"
FILES = {  # file -> (a linear weight's HF name, the type of the file's linear weights)
    "llamacpp-gemma-f16.gguf": ("model.layers.0.self_attn.q_proj.weight", "F16"),
    "llamacpp-gemma-q8_0.gguf": ("model.layers.0.self_attn.q_proj.weight", "Q8_0"),
    "llamacpp-gemma2-q8_0.gguf": ("model.layers.1.mlp.down_proj.weight", "Q8_0"),
    "llamacpp-gemma3-q8_0.gguf": ("model.layers.5.self_attn.k_proj.weight", "Q8_0"),
    "llamacpp-phi2-q8_0.gguf": ("model.layers.0.self_attn.dense.weight", "Q8_0"),
    "llamacpp-phi3-q8_0.gguf": ("model.layers.0.self_attn.qkv_proj.weight", "Q8_0"),  # fused, as in the file
    "llamacpp-phi3-longrope-q8_0.gguf": ("model.layers.1.mlp.gate_up_proj.weight", "Q8_0"),
    "llamacpp-stablelm-q8_0.gguf": ("model.layers.1.mlp.gate_proj.weight", "Q8_0"),
    "llamacpp-stablelm-qknorm-q8_0.gguf": ("model.layers.1.self_attn.o_proj.weight", "Q8_0"),
    "llamacpp-glm4-q8_0.gguf": ("model.layers.0.mlp.gate_up_proj.weight", "Q8_0"),  # fused, as in the file
}
# Past the original context of 64: transformers then turns with the long factors, as this run does.
PROMPT_LENGTHS = {"llamacpp-phi3-longrope-q8_0.gguf": 72}


@pytest.fixture(autouse=True)
def float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 activations against dequantized tiles, as transformers multiplies them (test_gguf_llamacpp.py
    says why): the logits then match within 1e-4, which proves the file reading."""
    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")


@pytest.mark.parametrize("name", sorted(FILES))
def test_llama_cpp_file_generates_like_transformers(name: str) -> None:
    path = FIXTURES / name
    architecture, config, _ = MODELS[name.rsplit("-", 1)[0]]
    linear, linear_type = FILES[name]
    assert read_hf_config(path)["architectures"] == [architecture]
    weights = dict(iter_weights(path))
    assert (type(weights[linear]) is GGMLTensor) == (linear_type != "F16")
    if linear_type != "F16":
        assert weights[linear].qtype.name == linear_type

    oracle = transformers_from_source(path, architecture, source_config(config))
    # a float32 KV cache, as the float32 oracle's (a GGUF file's default is float16, llama.cpp's)
    llm = LLM(model=str(path), num_blocks=64, block_size=8, kv_cache_dtype="float32")
    prompt = random_prompts(1000, [PROMPT_LENGTHS.get(name, 24)], seed=9)[0]  # past the sliding windows of 8
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(oracle, prompt), atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], greedy(16))[0].outputs[0].token_ids == hf_greedy(oracle, prompt, 16)
    tokenizer = llm.get_tokenizer()  # from the file
    text = "The model reads the file."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_gemma_norms_lose_the_one_llama_cpp_adds() -> None:
    path = FIXTURES / "llamacpp-gemma2-q8_0.gguf"
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(path).tensors}
    weights = dict(iter_weights(path))
    torch.testing.assert_close(weights["model.layers.1.post_feedforward_layernorm.weight"],
                               stored["blk.1.post_ffw_norm.weight"] - 1)


def test_tensor_without_counterpart_is_named(tmp_path: Path) -> None:
    source = gguf.GGUFReader(FIXTURES / "llamacpp-gemma2-q8_0.gguf")
    path = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    for field in source.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tuple(tensor.data.shape), raw_dtype=tensor.tensor_type)
    writer.add_tensor("blk.0.attn_sinks.weight", torch.zeros(4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(KeyError, match=r"'blk\.0\.attn_sinks\.weight' has no counterpart in the gemma2 pipeline "
                       r"\(GGUF architectures supported: deepseek2, gemma, gemma2, .*, qwen3moe, stablelm\)"):
        dict(iter_weights(path))


def test_phi2_file_with_fused_qkv(tmp_path: Path) -> None:
    """Phi-2 files from older converters hold one ``attn_qkv`` (q, k, v rows in turn): the same model."""
    source_path = FIXTURES / "llamacpp-phi2-q8_0.gguf"
    source = gguf.GGUFReader(source_path)
    path = tmp_path / "phi2-qkv.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    for field in source.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    tensors = {tensor.name: tensor for tensor in source.tensors}
    for name, tensor in tensors.items():
        block, _, kind = name.rpartition(".attn_")
        if kind.startswith(("q.", "k.", "v.")):
            if kind.startswith("q."):
                suffix = kind[2:]
                parts = [tensors[f"{block}.attn_{p}.{suffix}"] for p in "qkv"]
                data = np.concatenate([part.data for part in parts])
                writer.add_tensor(f"{block}.attn_qkv.{suffix}", data, raw_shape=tuple(data.shape),
                                  raw_dtype=tensor.tensor_type)
            continue
        writer.add_tensor(name, tensor.data, raw_shape=tuple(tensor.data.shape), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "blk.1.attn_qkv.weight" in {tensor.name for tensor in gguf.GGUFReader(path).tensors}

    architecture, config, _ = MODELS["llamacpp-phi2"]
    oracle = transformers_from_source(source_path, architecture, source_config(config))
    llm = LLM(model=str(path), num_blocks=64, block_size=8, kv_cache_dtype="float32")
    prompt = random_prompts(1000, [24], seed=9)[0]
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(oracle, prompt), atol=1e-4, rtol=1e-4)
