"""Loading .gguf files: ours against transformers reading the same file (gguf-py's dequantization).

The files are written with gguf's GGUFWriter as llama.cpp's converter writes them
(``pluginfer.cli.convert.write_gguf``); that transformers reads them back to the exact Hugging
Face weights is the check on the writer (``test_transformers_reads_our_f32_file_exactly``).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from pluginfer import LLM
from pluginfer.cli.convert import convert_to_gguf, write_gguf
from pluginfer.engine.loader import iter_weights, read_hf_config
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from pluginfer.models.gguf_llama import llama3_rope_factors
from pluginfer.text.tokenizer import load_tokenizer
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts, save_hf_model
from tests.quant.gguf_helpers import transformers_from_gguf

# Types ggml_blocks quantizes (as gguf-py / llama.cpp do); K-quants need rows of 256 (a wider model below).
BLOCK_TYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
K_TYPES = ["q4_k", "q6_k"]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.fixture(autouse=True)
def float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 activations against dequantized tiles, as transformers multiplies them: these tests hold
    our logits to transformers' within 1e-4, which proves the file reading. The cpu backend's fused
    kernel (int8 activations, on x86 CPUs with AVX2) moves these tiny random models' logits by up to
    ~0.25 (each linear's relative error is ~0.5 %, and random weights amplify it) and can flip a
    greedy near-tie; tests/backends/test_native_quant_dot.py holds it to this path."""
    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")


def load(path: Path, **kwargs: object) -> LLM:
    # a float32 KV cache, as the float32 oracle's (a GGUF file's default is float16, llama.cpp's)
    return LLM(model=str(path), num_blocks=64, block_size=8, kv_cache_dtype="float32", **kwargs)


def assert_matches_transformers(path: Path, prompt: list[int], atol: float = 1e-4) -> LLM:
    oracle = transformers_from_gguf(path)
    llm = load(path)
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(oracle, prompt), atol=atol, rtol=1e-4)
    out = llm.generate([prompt], greedy(12))[0].outputs[0].token_ids
    assert out == hf_greedy(oracle, prompt, 12)
    return llm


def test_transformers_reads_our_f32_file_exactly(tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> None:
    path = convert_to_gguf(tiny_llama_checkpoint[0], tmp_path / "llama-f32.gguf", "f32", "f32")
    reference = tiny_llama_checkpoint[1].state_dict()
    theirs = transformers_from_gguf(path).state_dict()
    for name, tensor in reference.items():
        assert torch.equal(theirs[name], tensor), name


def test_f32_file_generates_like_the_hf_model(tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> None:
    directory, model = tiny_llama_checkpoint
    path = convert_to_gguf(directory, tmp_path / "llama-f32.gguf", "f32", "f32")
    # Our reader gives back exactly the HF tensors (q/k un-permuted), dense where the file is F32.
    reference = model.state_dict()
    for name, tensor in iter_weights(path):
        assert not isinstance(tensor, GGMLTensor) and torch.equal(tensor, reference[name]), name
    prompt = random_prompts(200, [20], seed=1)[0]
    llm = load(path)
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(model, prompt), atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], greedy(12))[0].outputs[0].token_ids == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("quant", BLOCK_TYPES)
def test_block_types_match_transformers_on_the_dequantized_weights(
        quant: str, tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> None:
    path = convert_to_gguf(tiny_llama_checkpoint[0], tmp_path / f"llama-{quant}.gguf", quant, embedding_type=quant)
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors} == {"F32", quant.upper()}
    llm = assert_matches_transformers(path, random_prompts(200, [20], seed=2)[0])
    if quant not in ("f16", "bf16"):  # the linear layers hold the file's blocks, not dense weights
        pipeline = llm.engine.executor.pipeline
        qkv = pipeline.model.layers[0].self_attn.qkv_proj
        assert [(q.name, w.dtype) for q, w in qkv.gguf_groups] == [(quant.upper(), torch.uint8)]
        # so do the embedding and the LM head: no dense table of the vocabulary
        for table in (pipeline.model.embed_tokens.table, pipeline.lm_head.table):
            assert table.qtype.name == quant.upper() and table.raw.dtype == torch.uint8
        assert pipeline.model.embed_tokens.weight.numel() == pipeline.lm_head.weight.numel() == 0


def test_mixed_types_in_one_fused_layer(tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> None:
    """q/k Q4_0 with v Q8_0, gate Q5_0 with up Q4_1, a quantized embedding and LM head."""
    directory = tiny_llama_checkpoint[0]
    types = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        types.update({prefix + "self_attn.q_proj.weight": "q4_0", prefix + "self_attn.k_proj.weight": "q4_0",
                      prefix + "self_attn.v_proj.weight": "q8_0", prefix + "self_attn.o_proj.weight": "f16",
                      prefix + "mlp.gate_proj.weight": "q5_0", prefix + "mlp.up_proj.weight": "q4_1",
                      prefix + "mlp.down_proj.weight": "q5_1"})
    path = write_gguf(tmp_path / "mixed.gguf", read_hf_config(directory), load_tokenizer(directory),
                      iter_weights(directory), "q8_0", embedding_type="q8_0", types=types)
    llm = assert_matches_transformers(path, random_prompts(200, [20], seed=4)[0])
    layer = llm.engine.executor.pipeline.model.layers[1]
    assert [q.name for q, _ in layer.self_attn.qkv_proj.gguf_groups] == ["Q4_0", "Q8_0"]
    assert [q and q.name for q, _ in layer.self_attn.o_proj.gguf_groups] == [None]  # F16: a dense weight
    assert [q.name for q, _ in layer.mlp.gate_up_proj.gguf_groups] == ["Q5_0", "Q4_1"]


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    """Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k norm; explicit head_dim) and a K-quant-wide llama."""
    root = tmp_path_factory.mktemp("gguf_families")
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5)
    families = {
        "qwen2": ("Qwen2ForCausalLM", {**base, "tie_word_embeddings": True, "rope_theta": 1e6}),
        "qwen3": ("Qwen3ForCausalLM", {**base, "tie_word_embeddings": False}),
        # transformers' GGUF config mapping ignores key_length for qwen3: the HF model is the oracle here.
        "qwen3_head_dim_32": ("Qwen3ForCausalLM", {**base, "head_dim": 32, "tie_word_embeddings": False}),
        "llama3_rope": ("LlamaForCausalLM", {**base, "rope_scaling": dict(LLAMA3_ROPE), "max_position_embeddings": 16384}),
        "mistral_window": ("MistralForCausalLM", {**base, "sliding_window": 8}),
        "llama256": ("LlamaForCausalLM", {**base, "hidden_size": 256, "intermediate_size": 512,
                                          "num_attention_heads": 4, "num_key_value_heads": 2,
                                          "initializer_range": 0.05}),
    }
    paths = {}
    for family, (arch, config) in families.items():
        paths[family] = root / family
        save_hf_model(arch, config, paths[family], tiny_tokenizer_dir)
    return paths


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_qwen_files_match_transformers(family: str, quant: str, family_checkpoints: dict[str, Path],
                                       tmp_path: Path) -> None:
    path = convert_to_gguf(family_checkpoints[family], tmp_path / f"{family}.gguf", quant, "f32")
    assert_matches_transformers(path, random_prompts(200, [20], seed=5)[0])


def test_mistral_sliding_window_travels_in_the_metadata(family_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import transformers

    directory = family_checkpoints["mistral_window"]
    path = convert_to_gguf(directory, tmp_path / "mistral.gguf", "f32", "f32")
    config = read_hf_config(path)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["sliding_window"] == 8
    model = transformers.MistralForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = random_prompts(200, [24], seed=11)[0]  # three windows long
    llm = load(path)
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(model, prompt), atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], greedy(12))[0].outputs[0].token_ids == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_when_asked(dtype: str, tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> None:
    """``--dtype`` overrides the float32 default; the tiles are dequantized in that dtype."""
    path = convert_to_gguf(tiny_llama_checkpoint[0], tmp_path / "q8_0.gguf", "q8_0", "f16")
    prompt = random_prompts(200, [20], seed=12)[0]
    reference = prefill_logits(load(path), prompt)
    logits = prefill_logits(load(path, dtype=dtype), prompt)
    assert logits.dtype == torch.float32 and logits.shape == reference.shape
    # Measured: bfloat16 moves logits by 1.6% of their spread, float16 by 0.3%; a wrong layout moves them by all of it.
    assert (logits - reference).abs().max() < 0.05 * (reference.max() - reference.min())


def test_llama3_rope_scaling_travels_as_rope_freqs(family_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import transformers

    directory = family_checkpoints["llama3_rope"]
    path = convert_to_gguf(directory, tmp_path / "llama3.gguf", "f32", "f32")
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    factors = llama3_rope_factors(10000.0, 16, LLAMA3_ROPE).tolist()  # the file's divisors, applied as given
    assert read_hf_config(path)["rope_scaling"] == {"rope_type": "default", "frequency_factors": factors}
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = random_prompts(200, [20], seed=10)[0]
    llm = load(path, max_model_len=256)
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(model, prompt), atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], greedy(12))[0].outputs[0].token_ids == hf_greedy(model, prompt, 12)


def test_qwen3_head_dim_from_key_length(family_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import transformers

    directory = family_checkpoints["qwen3_head_dim_32"]
    path = convert_to_gguf(directory, tmp_path / "qwen3.gguf", "f32", "f32")
    assert read_hf_config(path)["head_dim"] == 32
    model = transformers.Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = random_prompts(200, [20], seed=7)[0]
    llm = load(path)
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(model, prompt), atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], greedy(12))[0].outputs[0].token_ids == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("quant", K_TYPES)
def test_k_quants_match_transformers(quant: str, family_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = convert_to_gguf(family_checkpoints["llama256"], tmp_path / f"{quant}.gguf", quant, quant)
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors} == {"F32", quant.upper()}
    assert_matches_transformers(path, random_prompts(200, [20], seed=6)[0])
