"""Files written by llama.cpp's own converter (fixtures/make_gguf_fixtures.py): an independent writer.

Our reading of each file against transformers reading the same file (gguf-py's dequantization,
transformers' own undoing of llama's q/k permutation).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from pluginfer import LLM
from pluginfer.engine.loader import iter_weights, read_hf_config
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from pluginfer.models.gguf_llama import llama3_rope_factors
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts
from tests.quant.gguf_helpers import transformers_from_gguf

FIXTURES = Path(__file__).parent / "fixtures"
FILES = {  # file -> (architecture, the type of its linear weights)
    "llamacpp-llama-f16.gguf": ("LlamaForCausalLM", "F16"),
    "llamacpp-llama3-f16.gguf": ("LlamaForCausalLM", "F16"),
    "llamacpp-llama-q8_0.gguf": ("LlamaForCausalLM", "Q8_0"),
    "llamacpp-qwen2-q8_0.gguf": ("Qwen2ForCausalLM", "Q8_0"),
}


@pytest.fixture(autouse=True)
def float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 activations against dequantized tiles, as transformers multiplies them: these tests hold
    our logits to transformers' within 1e-4, which proves the file reading. The cpu backend's fused
    kernel (int8 activations, on x86 CPUs with AVX2) moves these tiny random models' logits by up to
    ~0.25 (each linear's relative error is ~0.5 %, and random weights amplify it) and can flip a
    greedy near-tie; tests/backends/test_native_quant_dot.py holds it to this path."""
    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")


@pytest.mark.parametrize("name", sorted(FILES))
def test_llama_cpp_file_generates_like_transformers_reading_it(name: str) -> None:
    path = FIXTURES / name
    architecture, linear_type = FILES[name]
    config = read_hf_config(path)
    assert config["architectures"] == [architecture] and config["hidden_size"] == 64
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == linear_type
    weights = dict(iter_weights(path))
    if linear_type != "F16":  # the linears stay in their blocks
        assert isinstance(weights["model.layers.0.self_attn.q_proj.weight"], GGMLTensor)
    # the embedding (and an untied head) too, F16 ones as their 16-bit rows (no float32 copy)
    assert isinstance(weights["model.embed_tokens.weight"], GGMLTensor)

    rope = None
    if "llama3" in name:  # make_gguf_fixtures.py's LLAMA3_ROPE, which llama.cpp wrote as rope_freqs factors
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
        factors = llama3_rope_factors(config["rope_theta"], config["head_dim"], rope).tolist()  # applied as given
        assert config["rope_scaling"] == {"rope_type": "default", "frequency_factors": pytest.approx(factors)}
    oracle = transformers_from_gguf(path, rope)
    # a float32 KV cache, as the float32 oracle's (a GGUF file's default is float16, llama.cpp's)
    llm = LLM(model=str(path), num_blocks=64, block_size=8, kv_cache_dtype="float32")
    pipeline = llm.engine.executor.pipeline
    table = pipeline.model.embed_tokens.table
    assert table is not None and table.qtype.name == types["token_embd.weight"]
    assert pipeline.lm_head.table is (table if config.get("tie_word_embeddings") else pipeline.lm_head.table)
    prompt = random_prompts(900, [24], seed=9)[0]
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(oracle, prompt), atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], greedy(16))[0].outputs[0].token_ids == hf_greedy(oracle, prompt, 16)
    # The tokenizer and its special tokens come from the file.
    tokenizer = llm.get_tokenizer()
    text = "The model reads the file."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.eos_token == "</s>" and config["eos_token_id"] in llm.engine.eos_token_ids
