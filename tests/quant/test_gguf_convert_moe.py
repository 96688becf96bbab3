"""``pluginfer convert`` of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): experts merged per
layer as llama.cpp merges them. Oracles: transformers on the source checkpoint (an F32 file, so exact), and
llama.cpp reading the very same files (F32: logits within 1e-4; Q8_0: the same mean NLL within 1 %)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pluginfer import LLM
from pluginfer.cli import main
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts
from tests.quant.test_gguf_convert_families import save_checkpoint

CASES = {"llamacpp-mixtral": "llama", "llamacpp-qwen2moe": "qwen2moe", "llamacpp-qwen3moe": "qwen3moe"}


def llama_cpp_logits(path: Path, prompt: list[int], tmp_path: Path) -> torch.Tensor:
    llama_cpp = pytest.importorskip("llama_cpp")
    copy = tmp_path / f"llama-cpp-{path.name}"
    shutil.copy(path, copy)
    model = llama_cpp.Llama(model_path=str(copy), n_ctx=256, n_batch=256, logits_all=True, verbose=False,
                            n_threads=1, type_k=0, type_v=0)  # a float32 KV cache, as ours
    model.eval(prompt)
    return torch.tensor(np.array(model.scores[: len(prompt)]), dtype=torch.float32)


def mean_nll(logits: torch.Tensor, prompt: list[int]) -> float:
    return torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(prompt[1:])).item()


@pytest.mark.slow
@pytest.mark.parametrize("stem", sorted(CASES))
def test_converted_moe_file_reads_like_transformers_and_llama_cpp(stem: str, tmp_path: Path,
                                                                  tiny_tokenizer_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    architecture, config = save_checkpoint(stem, tmp_path / "hf", tiny_tokenizer_dir)
    import transformers

    oracle = getattr(transformers, architecture).from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    prompt = random_prompts(config["vocab_size"], [24], seed=5)[0]
    exact = tmp_path / "f32.gguf"
    assert main(["convert", "--model", str(tmp_path / "hf"), "--quant", "f32", "--embedding-type", "f32",
                 "--output", str(exact)]) == 0
    reader = gguf.GGUFReader(exact)
    assert reader.get_field("general.architecture").contents() == CASES[stem]
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    experts = config.get("num_local_experts") or config["num_experts"]
    assert tensors["blk.1.ffn_gate_exps.weight"].shape.tolist()[-1] == experts  # one merged tensor per projection
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"

    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")
    # a float32 KV cache, as the float32 oracle's (a GGUF file's default is float16, llama.cpp's)
    ours = LLM(model=str(exact), num_blocks=64, block_size=8, kv_cache_dtype="float32", max_model_len=256)
    logits = prefill_logits(ours, prompt)
    torch.testing.assert_close(logits, hf_logits(oracle, prompt), atol=1e-4, rtol=1e-4)
    assert ours.generate([prompt], greedy(12))[0].outputs[0].token_ids == hf_greedy(oracle, prompt, 12)
    torch.testing.assert_close(logits, llama_cpp_logits(exact, prompt, tmp_path), atol=1e-4, rtol=1e-4)
    del ours

    monkeypatch.delenv("PLUGINFER_QUANT_ACTIVATIONS")
    quantized = tmp_path / "q8_0.gguf"
    assert main(["convert", "--model", str(tmp_path / "hf"), "--quant", "q8_0", "--output", str(quantized)]) == 0
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(quantized).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == types["blk.1.ffn_up_exps.weight"] == "Q8_0"
    long_prompt = random_prompts(config["vocab_size"], [96], seed=6)[0]
    ours_q = prefill_logits(LLM(model=str(quantized), num_blocks=64, block_size=8, kv_cache_dtype="float32",
                                max_model_len=256), long_prompt)
    theirs_q = llama_cpp_logits(quantized, long_prompt, tmp_path)
    assert abs(mean_nll(ours_q, long_prompt) - mean_nll(theirs_q, long_prompt)) <= 0.01 * mean_nll(theirs_q,
                                                                                                     long_prompt)
