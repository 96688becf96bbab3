"""The latent KV cache: per token and layer only kv_lora_rank + qk_rope_head_dim values, by the cache's own accounting;
quantized (int8, fp8), the row's one scale serving key and value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pluginfer import LLM, SamplingParams
from pluginfer.layers import kv_quant
from tests.checkpoints import greedy, random_prompts, save_hf_model

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.2, q_lora_rank=24,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
LATENT, ROPE, LAYERS = 32, 8, 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("deepseek-v2")
    save_hf_model("DeepseekV2ForCausalLM", CONFIG, path, tiny_tokenizer_dir)
    return path


def allocated_bytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind every layer's (key, value) tensors."""
    storages = {}
    for pair in kv_caches:
        for tensor in pair:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_bytes_per_token_are_latent_plus_rope_key(checkpoint: Path, dtype: str) -> None:
    num_blocks, block_size = 12, 8
    llm = LLM(model=str(checkpoint), dtype=dtype, num_blocks=num_blocks, block_size=block_size)
    executor = llm.engine.executor
    itemsize = getattr(torch, dtype).itemsize
    expected = (LATENT + ROPE) * LAYERS * itemsize
    assert executor.pipeline.kv_cache_spec().bytes_per_token(getattr(torch, dtype)) == expected
    blocks = executor.kv_caches[0][0].shape[0]
    assert blocks in (num_blocks, num_blocks + 1)  # + the scratch block of the cuda backend's graph padding rows
    assert allocated_bytes(executor.kv_caches) == expected * blocks * block_size
    key, value = executor.kv_caches[0]
    assert key.shape == (num_blocks, block_size, 1, LATENT + ROPE)
    assert value.shape[-1] == LATENT and value.data_ptr() == key[..., ROPE:].data_ptr(), "the value is the key's latent"


def test_cached_latent_is_written_and_copied_for_forks(checkpoint: Path) -> None:
    """n > 1 forks copy a partial block; with the value inside the key, only keys move (and outputs agree)."""
    from pluginfer import SamplingParams

    llm = LLM(model=str(checkpoint), dtype="float32", num_blocks=32, block_size=8)
    prompt = random_prompts(1800, [13], seed=3)[0]
    single = llm.generate([prompt], greedy(6))[0].outputs[0].token_ids
    forked = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2))[0]
    assert [o.token_ids for o in forked.outputs] == [single, single]
    key, _ = llm.engine.executor.kv_caches[0]
    assert key.abs().sum() > 0


def test_prefix_cache_hit_reads_the_cached_latents(checkpoint: Path) -> None:
    """A second prompt sharing two full blocks starts from cached latents; its tokens equal a cold run's."""
    shared = random_prompts(1800, [16], seed=5)[0]
    first, second = shared + [11, 12, 13], shared + [21, 22, 23, 24]
    warm = LLM(model=str(checkpoint), dtype="float32", num_blocks=32, block_size=8)
    warm.generate([first], greedy(4))
    out = warm.generate([second], greedy(8))[0]
    assert out.num_cached_tokens == 16
    cold = LLM(model=str(checkpoint), dtype="float32", num_blocks=32, block_size=8, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == cold.generate([second], greedy(8))[0].outputs[0].token_ids


def _mean_nll(llm: LLM, ids: list[int]) -> float:
    [out] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1))
    logprobs = [entry[ids[i]] for i, entry in enumerate(out.prompt_logprobs) if i > 0]
    return -sum(getattr(value, "logprob", value) for value in logprobs) / len(logprobs)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
def test_a_quantized_latent_cache(checkpoint: Path, kv_cache_dtype: str) -> None:
    """One row [rope key | latent | scale] per token and layer; a 160-token text's mean NLL within 1% of a float16
    cache's (prefilled in chunks over the cached rows); a prefix-cache hit reads the quantized latents."""
    ids = random_prompts(1800, [160], seed=7)[0]

    def llm(dtype: str, **kwargs: object) -> LLM:
        return LLM(model=str(checkpoint), dtype="float32", num_blocks=48, block_size=8, kv_cache_dtype=dtype,
                   max_num_batched_tokens=48, **kwargs)

    reference = _mean_nll(llm("float16"), ids)
    quantized = llm(kv_cache_dtype)
    key, value = quantized.engine.executor.kv_caches[0]
    assert key.dtype == kv_quant.QUANTIZED_KV_DTYPES[kv_cache_dtype] and key.shape[-1] == ROPE + LATENT + 4
    assert value.shape[-1] == LATENT + 4 and value.data_ptr() == key[..., ROPE:].data_ptr()
    spec = quantized.engine.executor.pipeline.kv_cache_spec()
    assert spec.bytes_per_token(key.dtype) == (ROPE + LATENT + 4) * LAYERS
    nll = _mean_nll(quantized, ids)
    assert abs(nll - reference) <= 0.01 * reference, (nll, reference)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = quantized.generate([ids[:40]], params)[0].outputs[0].token_ids
    again = quantized.generate([ids[:40]], params)[0]
    assert again.num_cached_tokens >= 32 and list(again.outputs[0].token_ids) == list(first)
