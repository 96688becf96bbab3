"""The cases of tests/backends/test_triton_kernels.py for the layer ops, paged attention, the fused MoE and a
whole cuda backend step: each runs a Triton kernel under ``TRITON_INTERPRET=1`` against its torch reference
and returns a report (``error`` None when they agree). Also the comparisons every case uses.
"""

from __future__ import annotations

import torch

TOLERANCE = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2),
             "float16": dict(atol=5e-3, rtol=5e-3), "exact": dict(atol=0, rtol=0)}


def tensors(seed: int):  # a seeded random-tensor maker, on torch's default device (the GPU's in a GPU run)
    generator = torch.Generator(torch.get_default_device()).manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return randn, generator


def compare(ours: torch.Tensor, expected: torch.Tensor, dtype: str) -> dict:
    report = {"shape": list(ours.shape), "max_error": (ours.float() - expected.float()).abs().max().item(),
              "error": None}
    try:
        assert ours.dtype == expected.dtype, (ours.dtype, expected.dtype)
        torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])
    except AssertionError as exc:
        report["error"] = str(exc)
    return report


def compare_truncated(ours: torch.Tensor, expected: torch.Tensor, bound: float) -> dict:
    """bf16 under the interpreter, which truncates float32 -> bf16 where torch and a GPU round to nearest: an
    output (or an intermediate) may sit an ulp or more off, so the bound is on the relative error of the whole
    output, ``|ours - expected| / |expected|`` (torch's own bf16 against float32 is ~0.4 % for these cases)."""
    report = compare(ours, expected, "bfloat16")
    relative = ((ours.float() - expected.float()).norm() / expected.float().norm()).item()
    report["error"] = None if ours.dtype == expected.dtype and relative < bound else f"relative error {relative}"
    return report


def case_rms_norm(dtype: str, residual: bool, offset: float) -> dict:
    from pluginfer.backends.triton_kernels import rms_norm
    from pluginfer.layers import ops

    randn, _ = tensors(1)
    kind = getattr(torch, dtype)
    x, weight = randn(2, 3, 48, dtype=kind), randn(48, dtype=kind)
    base = randn(2, 3, 48, dtype=kind) if residual else None
    ours_residual, ref_residual = (None, None) if base is None else (base.clone(), base.clone())
    ours = rms_norm.rms_norm(x, ours_residual, weight, 1e-6, offset)
    report = compare(ours, ops.rms_norm(x, ref_residual, weight, 1e-6, offset), dtype)
    if residual and report["error"] is None:
        # bf16: Triton's interpreter truncates float32 -> bf16 where torch (and a GPU) round to nearest.
        residual_report = compare(ours_residual, ref_residual, dtype if dtype == "bfloat16" else "exact")
        report["error"] = residual_report["error"] and f"the residual sum differs: {residual_report['error']}"
    return report


def case_gated(dtype: str, activation: str) -> dict:
    from pluginfer.backends.triton_kernels import gated_activation
    from pluginfer.layers import ops

    randn, _ = tensors(2)
    x = randn(5, 2 * 40, dtype=getattr(torch, dtype))
    if activation == "silu":
        return compare(gated_activation.silu_and_mul(x), ops.silu_and_mul(x), dtype)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return compare(gated_activation.gelu_and_mul(x, approximate), ops.gelu_and_mul(x, approximate), dtype)


def case_rotary(dtype: str, neox: bool, rotary_dim: int) -> dict:
    from pluginfer.backends.triton_kernels import rotary
    from pluginfer.layers import ops

    randn, _ = tensors(3)
    head_dim, tokens = 32, 7
    qkv = randn(tokens, 6 * head_dim, dtype=getattr(torch, dtype))  # strided q/k views of a fused projection
    # 3 heads each: a head count that is not a power of two masks the kernel's head block
    query, key = qkv[:, :3 * head_dim].view(tokens, 3, head_dim), qkv[:, 3 * head_dim:].view(tokens, 3, head_dim)
    positions = torch.arange(3, 3 + tokens, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = (positions[:, None] * inv_freq).cos(), (positions[:, None] * inv_freq).sin()
    expected_query, expected_key = query.clone(), key.clone()
    name = "rotary_neox" if neox else "rotary_interleaved"
    getattr(ops, name)(expected_query, expected_key, cos, sin, rotary_dim)
    assert getattr(rotary, name)(query, key, cos, sin, rotary_dim) is True
    report = compare(torch.cat([query, key], dim=1), torch.cat([expected_query, expected_key], dim=1), dtype)
    if report["error"] is None and not torch.equal(qkv[:, 3 * head_dim:].view(tokens, 3, head_dim), key):
        report["error"] = "the key was not rotated in place"
    return report


# -- paged attention ---------------------------------------------------------------------------------
def _paged(seq_lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int, v_dim: int,
           block_size: int, dtype: torch.dtype, seed: int, latent: bool = False):
    randn, generator = tensors(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    order = torch.randperm(num_blocks, generator=generator)
    width = max(-(-n // block_size) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), width + 1, dtype=torch.int64)  # one spare column, as the engine pads
    used = 0
    for row, length in enumerate(seq_lens):
        count = -(-length // block_size)
        tables[row, :count] = order[used:used + count]
        used += count
    key_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    value_cache = (key_cache[..., head_dim - v_dim:] if latent
                   else randn(num_blocks, block_size, kv_heads, v_dim, dtype=dtype))
    # Slots no sequence owns hold large values: a kernel reading one by mistake leaves the tolerance far behind.
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for row, length in enumerate(seq_lens):
        positions = torch.arange(length)
        owned[tables[row, positions // block_size] * block_size + positions % block_size] = True
    for cache in (key_cache,) if latent else (key_cache, value_cache):
        cache.view(-1, *cache.shape[2:])[~owned] = 300.0
    tokens = sum(query_lens)
    query = randn(tokens, heads, head_dim, dtype=dtype)
    key = randn(tokens, kv_heads, head_dim, dtype=dtype)
    value = None if latent else randn(tokens, kv_heads, v_dim, dtype=dtype)
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, query_lens, strict=True)])
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    return query, key, value, key_cache, value_cache, tables, starts, torch.tensor(seq_lens), slots


def case_write_kv(dtype: str, latent: bool) -> dict:
    from pluginfer.backends.triton_kernels import write_kv
    from pluginfer.layers import attention_ops

    query, key, value, key_cache, value_cache, _, _, _, slots = _paged([9, 5], [3, 5], 4, 1 if latent else 2, 24,
                                                                       12 if latent else 16, 4,
                                                                       getattr(torch, dtype), 4, latent)
    ours = (key_cache.clone(), None)
    ours = (ours[0], ours[0][..., -12:] if latent else value_cache.clone())
    write_kv.write_kv(key, value, ours[0], ours[1], slots)
    attention_ops.write_kv(key, value, key_cache, value_cache, slots)
    report = compare(ours[0], key_cache, dtype)
    if report["error"] is None and not latent and not torch.equal(ours[1], value_cache):
        report["error"] = "values differ"
    return report


# (seq_lens, query_lens, heads, kv_heads, head_dim, v_dim, block_size)
DECODE_SHAPES = {
    "gqa": ([9, 17, 1, 40], [1] * 4, 4, 2, 16, 16, 4),
    "mha-block16": ([33, 2], [1, 1], 4, 4, 32, 32, 16),
    "mqa-vdim": ([21, 12], [1, 1], 4, 1, 48, 16, 8),
}
PREFILL_SHAPES = {
    "fresh-prompts": ([7, 20], [7, 20], 4, 2, 16, 16, 4),
    "chunk-and-prefix-hit": ([37, 11, 26], [5, 11, 17], 4, 2, 16, 16, 8),
    "mha-vdim": ([19, 4], [19, 3], 4, 4, 32, 16, 4),
}


def case_decode(dtype: str, shape: str, window: int | None, cap: float | None, keys_per_split: int,
                latent: bool = False) -> dict:
    from pluginfer.backends.triton_kernels import decode_attention
    from pluginfer.layers import attention_ops

    seq_lens, query_lens, heads, kv_heads, head_dim, v_dim, block_size = DECODE_SHAPES[shape]
    if latent:
        kv_heads = 1
    query, _, _, key_cache, value_cache, tables, _, lens, _ = _paged(seq_lens, query_lens, heads, kv_heads, head_dim,
                                                                     v_dim, block_size, getattr(torch, dtype), 5,
                                                                     latent)
    scale = head_dim ** -0.5
    ours = decode_attention.decode_attention(query, key_cache, value_cache, tables, lens, scale, window, cap,
                                             keys_per_split=keys_per_split)
    expected = attention_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, window, cap)
    return compare(ours, expected, dtype)


def case_prefill(dtype: str, shape: str, window: int | None, cap: float | None, latent: bool = False) -> dict:
    from pluginfer.backends.triton_kernels import prefill_attention
    from pluginfer.layers import attention_ops

    seq_lens, query_lens, heads, kv_heads, head_dim, v_dim, block_size = PREFILL_SHAPES[shape]
    if latent:
        kv_heads = 1
    query, _, _, key_cache, value_cache, tables, starts, lens, _ = _paged(
        seq_lens, query_lens, heads, kv_heads, head_dim, v_dim, block_size, getattr(torch, dtype), 6, latent)
    scale = head_dim ** -0.5
    arguments = (query, key_cache, value_cache, tables, starts, lens, max(query_lens), scale, window, cap)
    return compare(prefill_attention.paged_prefill_attention(*arguments),
                    attention_ops.paged_prefill_attention(*arguments), dtype)


# name: (tokens, experts, top_k, hidden, intermediate): the tiny Mixtral, Qwen3-MoE and DeepSeek models' experts.
MOE_SHAPES = {"mixtral": (7, 4, 2, 64, 128), "qwen3-moe": (5, 8, 2, 64, 64), "deepseek-v2-lite": (9, 6, 2, 64, 24),
              "deepseek-top3-decode": (1, 8, 3, 64, 48)}


def case_fused_moe(dtype: str, shape: str, activation: str, one_expert: bool = False) -> dict:
    from pluginfer.backends.triton_kernels import fused_moe
    from pluginfer.layers import ops

    randn, generator = tensors(9)
    tokens, experts, top_k, hidden_size, inter = MOE_SHAPES[shape]
    kind = getattr(torch, dtype)
    hidden = randn(tokens, hidden_size, dtype=kind)
    gate_up, down = (randn(experts, 2 * inter, hidden_size) * 0.2).to(kind), (randn(experts, hidden_size, inter) * 0.2).to(kind)
    logits = randn(tokens, experts)
    if one_expert:  # every token's first choice is expert 1: one long run, other experts empty
        logits[:, 1] += 100.0
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    arguments = (hidden, gate_up, down, weights, ids, activation)
    ours, expected = fused_moe.fused_moe(*arguments), ops.fused_moe(*arguments)
    # bf16: three truncations (gate/up, activation, down) put a few outputs ~4 ulps off; measured 1.4-1.7 %.
    return compare_truncated(ours, expected, 3e-2) if dtype == "bfloat16" else compare(ours, expected, dtype)


def case_lora_sgmv(dtype: str) -> dict:
    """A mixed LoRA step: 21 token rows over three slots of ranks 8, 3 and 5 (padded to 8) and base rows, through a
    fused layer of two projections; the shrink (A read transposed, strided) and the expand against the op's
    reference, then the layer's whole delta against the masked torch path."""
    import numpy as np

    from pluginfer.backends.triton_kernels import lora_sgmv
    from pluginfer.core.protocols import ShardSpec
    from pluginfer.layers import lora

    randn, _ = tensors(11)
    kind, device = getattr(torch, dtype), torch.get_default_device()
    token_slots = np.array([2, -1, 0, 0, 2, 1, -1, 2, 0, 0, 0, 1, 1, 2, 2, -1, 0, 2, 2, 2, 2])
    layers = []
    for kernel in (lora_sgmv.lora_sgmv, None):
        mapping = lora.LoRAMapping(device)
        layer = lora.LoRALayer(40, ShardSpec(output_sizes=(24, 18)), 3, 8, mapping, kind, device, kernel)
        layers.append((mapping, layer))
    for slot, rank in enumerate((8, 3, 5)):
        parts = {0: (randn(rank, 40) * 0.3, randn(24, rank) * 0.3, 0.5),
                 1: (randn(rank, 40) * 0.3, randn(18, rank) * 0.3, 0.5)}
        for _, layer in layers:
            layer.set_slot(slot, parts)
    x, base = randn(21, 40, dtype=kind), randn(21, 42, dtype=kind)
    for mapping, _ in layers:
        mapping.set(token_slots)
    (mapping, ours_layer), (_, torch_layer) = layers
    groups = mapping.groups
    shrunk, expected_shrunk = (torch.zeros(21, 16) for _ in range(2))
    lora_sgmv.lora_sgmv(x, ours_layer.a.transpose(1, 2), shrunk, *groups)
    lora.lora_sgmv(x, ours_layer.a.transpose(1, 2), expected_shrunk, *groups)
    report = compare(shrunk, expected_shrunk, "float32" if dtype == "float32" else "bfloat16")
    if report["error"] is not None:
        return {**report, "error": f"shrink: {report['error']}"}
    ours, expected = base.clone(), base.clone()
    lora_sgmv.lora_sgmv(expected_shrunk, ours_layer.b, ours, *groups)
    lora.lora_sgmv(expected_shrunk, ours_layer.b, expected, *groups)
    report = compare(ours, expected, dtype)
    if report["error"] is not None:
        return {**report, "error": f"expand: {report['error']}"}
    return compare(ours_layer(x, base.clone()), torch_layer(x, base.clone()), dtype)


def case_align_by_expert() -> dict:
    """The sorted pairs hold every pair once, grouped by expert in runs padded to 16; blocks name their expert."""
    from pluginfer.backends.triton_kernels import fused_moe

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])
    pairs, blocks = fused_moe.align_by_expert(ids, 5, 16)
    flat = ids.flatten()
    runs = [pairs[i * 16:(i + 1) * 16] for i in range(blocks.shape[0])]
    report = {"error": None}
    real = [p for run in runs for p in run.tolist() if p < flat.numel()]
    if sorted(real) != list(range(flat.numel())):
        report["error"] = f"pairs lost or repeated: {real}"
    for expert, run in zip(blocks.tolist(), runs):
        members = [p for p in run.tolist() if p < flat.numel()]
        if any(int(flat[p]) != expert for p in members):
            report["error"] = f"block of expert {expert} holds pairs of others: {members}"
    if pairs.shape[0] != 16 * blocks.shape[0] or pairs.shape[0] < 16 * 4:  # experts 0-3 used: 4 runs
        report["error"] = f"capacity {pairs.shape[0]} for {blocks.shape[0]} blocks"
    return report


def case_backend(dtype: str, latent: bool) -> dict:
    """CudaBackend end to end on one mixed step (decodes, a chunk over cached blocks, a fresh prompt), against
    the cpu backend; then ``copy_blocks`` and the latent cache's value view."""
    from pluginfer.backends import cuda
    from pluginfer.backends.cpu import backend as cpu
    from pluginfer.core.protocols import KVCacheSpec
    from tests.backends.paged import paged_batch

    kind = getattr(torch, dtype)
    randn, _ = tensors(8)
    backend, reference = cuda.CudaBackend(device=torch.get_default_device()), cpu.CpuBackend()
    reference.native_kernels = False
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1 if latent else 2, head_dim=24, v_head_dim=24,
                       value_in_key=16 if latent else None)
    caches = backend.allocate_kv_cache(spec, 24, 4, kind)
    expected_caches = reference.allocate_kv_cache(spec, 24, 4, kind)
    if latent and caches[0][1].data_ptr() != caches[0][0][..., 24 - 16:].data_ptr():
        return {"error": "the latent value is not a view of the key cache"}
    tables, seq_lens, query_lens = [[3, 1], [7, 2, 9], [0, 4, 5, 6], [8, 10]], [6, 9, 14, 5], [1, 1, 6, 5]
    report = None
    for step in range(2):  # the second step reads what the first wrote
        batch = paged_batch(backend, tables, seq_lens, query_lens, 4)
        reference_batch = paged_batch(reference, tables, seq_lens, query_lens, 4)
        tokens = sum(query_lens)
        query = randn(tokens, 4, 24, dtype=kind)
        key = randn(tokens, spec.num_kv_heads, 24, dtype=kind)
        value = None if latent else randn(tokens, 2, 24, dtype=kind)
        ours = backend.paged_attention(query, key, value, caches[0], batch, 0.2, 7 if step else None)
        expected = reference.paged_attention(query, key, value, expected_caches[0], reference_batch, 0.2,
                                             7 if step else None)
        report = compare(ours, expected, dtype)
        if report["error"]:
            return report
        seq_lens = [n + 1 for n in seq_lens]
        query_lens = [1, 1, 1, 1]
    backend.copy_blocks(caches, [(3, 11)])
    if not torch.equal(caches[0][0][11], caches[0][0][3]) or not torch.equal(caches[0][1][11], caches[0][1][3]):
        report["error"] = "copy_blocks did not copy block 3 to 11"
    return report
