"""The KV cache's size by default (sized for the job, not a fraction of free memory), its lazily zeroed
allocation on the CPU, and the start-up error when it cannot hold one sequence."""

from __future__ import annotations

import logging

import psutil
import pytest
import torch

from pluginfer import LLM, SamplingParams
from pluginfer.backends.cpu import backend as cpu
from pluginfer.backends.cpu.backend import CpuBackend
from pluginfer.core.protocols import KVCacheSpec

BYTES_PER_TOKEN = 2 * 2 * 16 * 2 * 4  # the tiny llama: 2 layers x 2 KV heads x dim 16 x (K, V) x float32


def test_cpu_budget_is_a_fixed_default_capped_by_free_memory(monkeypatch):
    backend = CpuBackend(native_kernels=False)
    monkeypatch.setattr(cpu, "_available_memory", lambda: 64 * 2**30)
    assert backend.kv_cache_budget_bytes(None, 0.3) == cpu.DEFAULT_KV_CACHE_BYTES == 4 * 2**30
    monkeypatch.setattr(cpu, "_available_memory", lambda: 2 * 2**30)
    assert backend.kv_cache_budget_bytes(None, 0.5) == 2**30
    assert backend.kv_cache_budget_bytes(12345, 0.3) == 12345


def test_the_cache_is_zeros_that_touch_no_page_until_written():
    spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=64)
    backend = CpuBackend(native_kernels=False)
    before = psutil.Process().memory_info().rss
    caches = backend.allocate_kv_cache(spec, num_blocks=2048, block_size=16, dtype=torch.float32)  # 1 GiB
    assert psutil.Process().memory_info().rss - before < 64 * 2**20  # nothing written yet
    assert len(caches) == 4
    for key, value in caches:
        assert key.shape == value.shape == (2048, 16, 8, 64) and key.dtype == torch.float32
        assert key.is_contiguous() and value.is_contiguous() and key.data_ptr() % 64 == 0
    key, value = caches[1]
    key[5].fill_(1.0)
    value[7, 3].fill_(2.0)
    assert float(key.sum()) == 16 * 8 * 64 and float(value.sum()) == 2 * 8 * 64
    others = [t for i, pair in enumerate(caches) if i != 1 for t in pair]
    assert all(float(t.abs().sum()) == 0.0 for t in others)  # each tensor has its own bytes
    assert float(caches[1][0][4].abs().sum()) == 0.0 and float(caches[1][0][6].abs().sum()) == 0.0


def test_a_latent_cache_keeps_its_value_inside_the_key():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=40, value_in_key=32)
    caches = CpuBackend(native_kernels=False).allocate_kv_cache(spec, 8, 4, torch.bfloat16)
    for key, value in caches:
        assert key.shape == (8, 4, 1, 40) and value.shape == (8, 4, 1, 32) and key.dtype == torch.bfloat16
        key.fill_(3)
        assert float(value.float().mean()) == 3.0  # a view of the key's last features


def test_under_another_default_device_it_allocates_there():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16)
    with torch.device("meta"):
        ((key, value),) = CpuBackend(native_kernels=False).allocate_kv_cache(spec, 4, 8, torch.float32)
    assert key.device.type == value.device.type == "meta"


def test_by_default_the_cache_holds_what_the_scheduler_can_use(tiny_llama_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="pluginfer.engine.worker")
    llm = LLM(str(tiny_llama_checkpoint[0]), dtype="float32", block_size=8, max_num_seqs=3)
    try:
        assert llm.engine.block_manager.num_blocks == 3 * 256 // 8  # max_num_seqs x max_model_len
        assert "768 tokens (96 blocks of 8, 0.4 MiB): max_num_seqs 3 x max_model_len 256" in caplog.text
        outputs = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(outputs[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_a_budget_below_one_sequence_names_both_numbers_and_the_flag(tiny_llama_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="pluginfer.engine.worker")
    budget = 100 * BYTES_PER_TOKEN  # 100 tokens: 96 in whole blocks of 8, one sequence needs 256
    with pytest.raises(ValueError) as error:
        LLM(str(tiny_llama_checkpoint[0]), dtype="float32", block_size=8, kv_cache_memory=budget)
    message = str(error.value)
    assert f"cache.kv_cache_memory (--kv-cache-memory): {budget} bytes hold 96 tokens" in message
    assert "one sequence of max_model_len 256 needs 256 tokens" in message
    assert "raise --kv-cache-memory or lower --max-model-len" in message
    llm = LLM(str(tiny_llama_checkpoint[0]), dtype="float32", block_size=8, kv_cache_memory=budget,
              max_model_len=64)  # what the message offers works
    try:
        assert llm.engine.block_manager.num_blocks == 12
        assert f"what {budget} bytes from cache.kv_cache_memory" in caplog.text
    finally:
        llm.close()
