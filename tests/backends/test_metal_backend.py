"""The metal backend without Apple hardware: registration, availability, selection, and its attention
(the cpu backend's torch path by composition) run with the device set to the CPU."""

from __future__ import annotations

import pytest
import torch

from pluginfer import LLM
from pluginfer.backends import metal
from pluginfer.backends import plugin as backends_plugin
from pluginfer.backends.cpu import backend as cpu
from pluginfer.core import kernels
from pluginfer.core.protocols import KVCacheSpec, RankInfo
from pluginfer.core.registry import Registry, get_registry
from pluginfer.layers import attention_ops
from tests.backends.paged import paged_batch

needs_no_mps = pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an MPS device")


@needs_no_mps
def test_listed_unusable_and_selection_fails_with_the_reason(tiny_llama_checkpoint) -> None:
    registry = Registry()
    registry.register(backends_plugin, name="builtin-backends")
    spec = registry.resolve("backend", "mps")
    assert spec.name == "metal" and registry.usable(spec)[0] is False
    assert registry.usable(spec)[1].startswith("no MPS device")
    assert "backend metal [mps]" in get_registry().describe()
    with pytest.raises(RuntimeError, match="backend plugin 'metal' cannot run here: no MPS device"):
        LLM(model=str(tiny_llama_checkpoint[0]), backend="metal", num_blocks=8)
    with pytest.raises(RuntimeError, match="backend metal cannot run here: no MPS device"):
        metal.build()


def test_more_than_one_rank_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metal, "why_not_usable", lambda: None)
    with pytest.raises(ValueError, match="backend metal runs one rank"):
        metal.build(None, RankInfo(rank=0, world_size=2, tp_size=2))


def test_tensors_are_made_on_the_backend_device() -> None:
    backend = metal.MetalBackend(device=torch.device("meta"))
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8)
    caches = backend.allocate_kv_cache(spec, 6, 4, torch.float16)
    assert all(t.device.type == "meta" and t.dtype == torch.float16 for pair in caches for t in pair)
    assert backend.op("rms_norm") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "latent"])
def test_attention_equals_the_reference(dtype: torch.dtype, latent: bool) -> None:
    backend = metal.MetalBackend(device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1 if latent else 2, head_dim=16, value_in_key=8 if latent else None)
    key_cache, value_cache = backend.allocate_kv_cache(spec, 16, 4, dtype)[0]
    tables, seq_lens, query_lens = [[3, 1], [7, 2, 9], [0, 4, 5, 6]], [6, 9, 14], [1, 1, 6]
    tokens = sum(query_lens)
    query = torch.randn(tokens, 4, 16, generator=generator).to(dtype)
    key = torch.randn(tokens, spec.num_kv_heads, 16, generator=generator).to(dtype)
    value = None if latent else torch.randn(tokens, 2, 16, generator=generator).to(dtype)
    key_cache.normal_(generator=generator)
    if not latent:
        value_cache.normal_(generator=generator)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    ours = backend.paged_attention(query, key, value, (key_cache, value_cache),
                                   paged_batch(backend, tables, seq_lens, query_lens, 4), 0.25, 5, 2.0)
    batch = paged_batch(cpu.CpuBackend(native_kernels=False), tables, seq_lens, query_lens, 4)
    batch.attention = attention_ops.paged_attention_metadata(batch)
    expected = attention_ops.paged_attention(kernels.KernelTable("reference"), query, key, value,
                                       (expected_key, expected_key[..., -8:] if latent else expected_value), batch,
                                       0.25, 5, 2.0)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours, expected, **tolerance)
    assert torch.equal(key_cache, expected_key)
    backend.copy_blocks([(key_cache, value_cache)], [(3, 12)])
    assert torch.equal(key_cache[12], key_cache[3]) and torch.equal(value_cache[12], value_cache[3])
