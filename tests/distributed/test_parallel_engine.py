"""Tensor and pipeline parallelism end to end: N ranks against the same model on one rank (the oracle).

Every engine here spawns its other ranks as local processes (the ``spawn`` launcher) that meet over
gloo on 127.0.0.1. Greedy continuations must be identical and prefill logits equal within float32
tolerance: the ranks sum partial products in another order than one rank does (row-parallel
all-reduce), so logits differ by rounding, a few 1e-6 here; 1e-4 is the bound the transformers
oracle uses too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pluginfer import LLM, SamplingParams
from tests.checkpoints import greedy, prefill_logits, random_prompts, save_hf_model
from tests.models.family_cases_deepseek import CASES as DEEPSEEK_CASES
from tests.models.family_cases_moe import CASES as MOE_CASES
from tests.models.family_cases_qwen_glm_stablelm import CASES as QWEN_CASES

pytestmark = pytest.mark.slow

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
FAMILIES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "qwen3": QWEN_CASES["qwen3-qk-norm-tied-headdim"][:2],
    "mixtral": MOE_CASES["mixtral-8-experts-top2"][:2],
    "qwen3-moe": MOE_CASES["qwen3-moe-norm-topk-mixed-layers"][:2],
    "deepseek-v2": DEEPSEEK_CASES["deepseek-v2-group-limited"][:2],
    "deepseek-v3": DEEPSEEK_CASES["deepseek-v3-yarn"][:2],
}
FIXTURES = Path(__file__).parents[1] / "quant" / "fixtures"
ENGINE = dict(dtype="float32", num_blocks=96, block_size=8, max_num_seqs=8, timeout_s=60.0)


def _compare(path: Path, parallel: dict, prompts: list[list[int]], max_tokens: int = 8,
             logits_prompt: int = 1, atol: float = 1e-4) -> None:
    reference = LLM(str(path), **ENGINE)
    expected = reference.generate(prompts, greedy(max_tokens))
    expected_logits = prefill_logits(reference, prompts[logits_prompt])
    del reference
    with LLM(str(path), **ENGINE, **parallel) as parallel_llm:
        got = parallel_llm.generate(prompts, greedy(max_tokens))
        got_logits = prefill_logits(parallel_llm, prompts[logits_prompt])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    torch.testing.assert_close(got_logits, expected_logits, atol=atol, rtol=1e-4)


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    paths = {}
    for name, (arch, overrides) in FAMILIES.items():
        paths[name] = tmp_path_factory.mktemp(name)
        save_hf_model(arch, {**BASE, **overrides}, paths[name], tiny_tokenizer_dir)
    return paths


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tensor_parallel_2_equals_one_rank(family: str, family_checkpoints: dict[str, Path]) -> None:
    vocab = json.loads((family_checkpoints[family] / "config.json").read_text())["vocab_size"]
    _compare(family_checkpoints[family], {"tensor_parallel_size": 2}, random_prompts(vocab, [5, 19, 11]))


@pytest.mark.parametrize("family", ["llama-gqa", "deepseek-v3", "qwen3-moe"])
def test_pipeline_parallel_2_equals_one_rank(family: str, family_checkpoints: dict[str, Path]) -> None:
    vocab = json.loads((family_checkpoints[family] / "config.json").read_text())["vocab_size"]
    _compare(family_checkpoints[family], {"pipeline_parallel_size": 2}, random_prompts(vocab, [5, 19, 11]))


def test_gptq_act_order_under_tensor_parallelism(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "gptq_awq" / "base", tmp_path / "base")  # the shared unquantized tensors
    path = tmp_path / "gptq_b4_g32_act_asym"
    shutil.copytree(FIXTURES / "gptq_awq" / path.name, path)
    _compare(path, {"tensor_parallel_size": 2}, random_prompts(512, [7, 13]))


@pytest.mark.parametrize("fixture", ["llamacpp-llama-q8_0.gguf", "llamacpp-qwen2-q8_0.gguf"], ids=["untied", "tied"])
def test_gguf_file_under_tensor_parallelism(fixture: str, tmp_path: Path) -> None:
    """Q8_0 linears, embedding and LM head (each rank holds its rows of the quantized vocabulary table;
    the qwen2 file's head is its embedding)."""
    path = tmp_path / "model.gguf"
    shutil.copy(FIXTURES / fixture, path)
    # Looser than the float models' 1e-4: each linear quantizes its input per block of 32 to int8, so two
    # float32 sums that round apart by an ulp (one rank's down projection sums 128 inputs, each of two ranks
    # 64; from 5 rows the AMX tiles add the blocks in another order than the VNNI kernel) can put a value
    # on the other side of a rounding point: one level of one block, ~1 % of that block's largest input.
    # Measured: 1-2e-6 without a flip, 0.0097 with one (the tied file, one rank on AMX tiles).
    _compare(path, {"tensor_parallel_size": 2}, random_prompts(1000, [7, 13]), atol=0.03)


def test_n_prefix_caching_and_preemption_under_tensor_parallelism(family_checkpoints: dict[str, Path]) -> None:
    """n > 1 (block copies on every rank), a shared prefix (cached blocks) and a cache too small for all
    sequences at once (preemption by recompute): the same tokens as one rank under the same pressure."""
    path = family_checkpoints["llama-gqa"]
    prefix = random_prompts(1000, [24], seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(1000, [3, 6, 4, 9], seed=4)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2 if i == 0 else 1)
              for i in range(len(prompts))]
    pressure = dict(ENGINE, num_blocks=14, max_num_seqs=4)
    reference = LLM(str(path), **pressure)
    expected = reference.generate(prompts, params)
    del reference
    with LLM(str(path), **pressure, tensor_parallel_size=2) as parallel_llm:
        got = parallel_llm.generate(prompts, params)
        assert parallel_llm.engine.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    assert sum(o.num_cached_tokens for o in got) > 0
