"""Quantized KV caches end to end on the tiny random llama (float32 weights, head dim 16, GQA): a text's mean NLL
within 1% of a float16 cache's, greedy tokens that transformers' float32 model also rates best or nearly so, a
prefix-cache hit reading the quantized blocks of an earlier request, and the bad-config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pluginfer import LLM, SamplingParams
from pluginfer.core.config import build_config
from pluginfer.core.protocols import KVCacheSpec
from pluginfer.layers import kv_quant
from tests.checkpoints import hf_logits

TEXT = (Path(__file__).parents[2] / "pluginfer" / "demo" / "corpus.txt").read_text()[:3000]
# How far below transformers' best logit a greedy pick of a quantized run may be: a pick flips only where the
# float model's top two are about this close. Set from each format's rounding step relative to a value (int8:
# 1/254 of the row's absmax; E4M3: 2^-4; E5M2: 2^-3), about 3x the worst seen on this model (0.015, 0.20, 0.76).
NEAR_TIE = {"int8": 0.05, "fp8": 0.6, "fp8_e5m2": 2.0}


def _llm(path: Path, kv_cache_dtype: str, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, kv_cache_dtype=kv_cache_dtype,
               max_num_batched_tokens=64, **kwargs)


def _mean_nll(llm: LLM, ids: list[int]) -> float:
    """The text's mean negative log-likelihood from prompt_logprobs (prefilled in chunks of 64 tokens)."""
    [out] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1))
    logprobs = [entry[ids[i]] for i, entry in enumerate(out.prompt_logprobs) if i > 0]
    return -sum(getattr(value, "logprob", value) for value in logprobs) / len(logprobs)


@pytest.fixture(scope="module")
def float16_nll(tiny_llama_checkpoint) -> tuple[list[int], float]:
    llm = _llm(tiny_llama_checkpoint[0], "float16")
    ids = llm.engine.tokenizer.encode(TEXT)[:200]
    return ids, _mean_nll(llm, ids)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
def test_the_mean_nll_stays_within_one_percent_of_a_float16_cache(tiny_llama_checkpoint, float16_nll,
                                                                   kv_cache_dtype: str) -> None:
    path, model = tiny_llama_checkpoint
    ids, reference = float16_nll
    llm = _llm(path, kv_cache_dtype)
    key_cache, value_cache = llm.engine.executor.kv_caches[0]
    assert key_cache.dtype == kv_quant.QUANTIZED_KV_DTYPES[kv_cache_dtype] and key_cache.shape[-1] == 16 + 4
    nll = _mean_nll(llm, ids)
    assert abs(nll - reference) <= 0.01 * reference
    # the float16 cache itself is transformers' float32 model within rounding
    expected = torch.log_softmax(hf_logits(model, ids), -1)[torch.arange(len(ids) - 1), ids[1:]].mean()
    assert abs(reference + float(expected)) <= 1e-3 * reference

    prompts = [ids[:40], ids[40:70], ids[70:100]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        generated = list(out.outputs[0].token_ids)
        logits = hf_logits(model, prompt + generated)[len(prompt) - 1:-1]
        gaps = logits.max(-1).values - logits[torch.arange(len(generated)), generated]
        assert float(gaps.max()) <= NEAR_TIE[kv_cache_dtype], (kv_cache_dtype, gaps)

    # A second request for the same prompt reads the first one's quantized blocks from the prefix cache.
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([ids[:64]], params)[0].outputs[0].token_ids
    hits = llm.engine.block_manager.prefix_cache_hits
    again = llm.generate([ids[:64]], params)[0].outputs[0].token_ids
    assert list(first) == list(again) and llm.engine.block_manager.prefix_cache_hits > hits


def test_a_backend_without_a_kernel_for_the_dtype_is_a_start_up_error_naming_both() -> None:
    class FloatOnly:
        name = "float-only"
        kv_cache_dtypes = kv_quant.FLOAT_KV_DTYPES

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match=r"kv_cache_dtype int8: the float-only backend has no attention kernel "
                                         r"reading int8 KV caches \(it reads bfloat16, float16, float32\)"):
        kv_quant.check_kv_cache_dtype(FloatOnly(), spec, torch.int8, "int8")
    kv_quant.check_kv_cache_dtype(FloatOnly(), spec, torch.float16, "float16")
    latent = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=576, value_in_key=512)
    from pluginfer.backends.cpu.backend import CpuBackend

    kv_quant.check_kv_cache_dtype(CpuBackend, latent, torch.float8_e4m3fn, "fp8")  # the latent's view reads the key's scale
    with pytest.raises(ValueError, match="a head dimension of 510 is no multiple of 4"):
        kv_quant.check_kv_cache_dtype(CpuBackend, KVCacheSpec(2, 1, 576, value_in_key=510), torch.int8, "int8")
    with pytest.raises(ValueError, match="a head dimension of 18 is no multiple of 4"):
        kv_quant.check_kv_cache_dtype(CpuBackend, KVCacheSpec(1, 1, 18), torch.int8, "int8")


def test_the_engine_refuses_at_start_up_before_loading_weights(tiny_llama_checkpoint, monkeypatch) -> None:
    from pluginfer.backends.cpu.backend import CpuBackend

    monkeypatch.setattr(CpuBackend, "kv_cache_dtypes", kv_quant.FLOAT_KV_DTYPES)
    with pytest.raises(ValueError, match="fp8_e5m2: the cpu backend has no attention kernel"):
        _llm(tiny_llama_checkpoint[0], "fp8_e5m2")


def test_a_bad_kv_cache_dtype_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"cache\.kv_cache_dtype"):
        build_config(model="m", **{"cache.kv_cache_dtype": "int4"})
    assert build_config(model="m", **{"cache.kv_cache_dtype": "fp8"}).cache.kv_cache_dtype == "fp8"


def test_a_quantized_cache_holds_about_twice_a_16_bit_caches_tokens() -> None:
    spec = KVCacheSpec(num_layers=24, num_kv_heads=2, head_dim=64)  # Qwen2.5-0.5B's cache
    ratio = spec.bytes_per_token(torch.float16) / spec.bytes_per_token(torch.int8)
    assert ratio == pytest.approx(2 * 64 / 68)  # 64 codes and a 4-byte scale per row


@pytest.mark.slow
def test_preemption_by_recompute_gives_each_request_its_answer_alone(tiny_llama_checkpoint) -> None:
    """8 requests over a 96-token int8 cache take turns; a preempted one recomputes its quantized rows."""
    llm = LLM(model=str(tiny_llama_checkpoint[0]), dtype="float32", num_blocks=12, block_size=8,
              kv_cache_dtype="int8", enable_prefix_caching=False)
    prompts = [list(range(100 + i, 116 + i)) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    together = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    alone = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts[:3]]
    assert [list(tokens) for tokens in together[:3]] == [list(tokens) for tokens in alone]
