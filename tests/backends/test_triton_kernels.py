"""Every Triton kernel of the cuda backend under ``TRITON_INTERPRET=1`` against its torch reference.

The references are the ops of ``pluginfer.core.kernels`` (``tests/core/test_kernels.py`` holds them
equal to the layers and to the cpu backend). Triton reads ``TRITON_INTERPRET`` once, at import, so the
kernels run in a fresh interpreter: this file executed as a script with the variable set; the tests read
the JSON it prints. Shapes are the tiny models' (heads 4, KV heads 2 or 1, head dims 16 to 48, blocks
of 4 to 16 tokens); float32 cases use float32 tolerances, bf16/fp16 ones half-precision ones.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOLERANCE = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2),
             "float16": dict(atol=5e-3, rtol=5e-3), "exact": dict(atol=0, rtol=0)}


def _tensors(seed: int):  # a seeded random-tensor maker
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return randn, generator


def _compare(ours: torch.Tensor, expected: torch.Tensor, dtype: str) -> dict:
    report = {"shape": list(ours.shape), "max_error": (ours.float() - expected.float()).abs().max().item(),
              "error": None}
    try:
        assert ours.dtype == expected.dtype, (ours.dtype, expected.dtype)
        torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])
    except AssertionError as exc:
        report["error"] = str(exc)
    return report


def _compare_truncated(ours: torch.Tensor, expected: torch.Tensor, bound: float) -> dict:
    """bf16 under the interpreter, which truncates float32 -> bf16 where torch and a GPU round to nearest: an
    output (or an intermediate) may sit an ulp or more off, so the bound is on the relative error of the whole
    output, ``|ours - expected| / |expected|`` (torch's own bf16 against float32 is ~0.4 % for these cases)."""
    report = _compare(ours, expected, "bfloat16")
    relative = ((ours.float() - expected.float()).norm() / expected.float().norm()).item()
    report["error"] = None if ours.dtype == expected.dtype and relative < bound else f"relative error {relative}"
    return report


def case_rms_norm(dtype: str, residual: bool, offset: float) -> dict:
    from pluginfer.backends.triton_kernels import rms_norm
    from pluginfer.core import kernels

    randn, _ = _tensors(1)
    kind = getattr(torch, dtype)
    x, weight = randn(2, 3, 48, dtype=kind), randn(48, dtype=kind)
    base = randn(2, 3, 48, dtype=kind) if residual else None
    ours_residual, ref_residual = (None, None) if base is None else (base.clone(), base.clone())
    ours = rms_norm.rms_norm(x, ours_residual, weight, 1e-6, offset)
    report = _compare(ours, kernels.rms_norm(x, ref_residual, weight, 1e-6, offset), dtype)
    if residual and report["error"] is None:
        # bf16: Triton's interpreter truncates float32 -> bf16 where torch (and a GPU) round to nearest.
        residual_report = _compare(ours_residual, ref_residual, dtype if dtype == "bfloat16" else "exact")
        report["error"] = residual_report["error"] and f"the residual sum differs: {residual_report['error']}"
    return report


def case_gated(dtype: str, activation: str) -> dict:
    from pluginfer.backends.triton_kernels import gated_activation
    from pluginfer.core import kernels

    randn, _ = _tensors(2)
    x = randn(5, 2 * 40, dtype=getattr(torch, dtype))
    if activation == "silu":
        return _compare(gated_activation.silu_and_mul(x), kernels.silu_and_mul(x), dtype)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return _compare(gated_activation.gelu_and_mul(x, approximate), kernels.gelu_and_mul(x, approximate), dtype)


def case_rotary(dtype: str, neox: bool, rotary_dim: int) -> dict:
    from pluginfer.backends.triton_kernels import rotary
    from pluginfer.core import kernels

    randn, _ = _tensors(3)
    head_dim, tokens = 32, 7
    qkv = randn(tokens, 6 * head_dim, dtype=getattr(torch, dtype))  # strided q/k views of a fused projection
    query, key = qkv[:, :4 * head_dim].view(tokens, 4, head_dim), qkv[:, 4 * head_dim:].view(tokens, 2, head_dim)
    positions = torch.arange(3, 3 + tokens, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = (positions[:, None] * inv_freq).cos(), (positions[:, None] * inv_freq).sin()
    expected_query, expected_key = query.clone(), key.clone()
    name = "rotary_neox" if neox else "rotary_interleaved"
    getattr(kernels, name)(expected_query, expected_key, cos, sin, rotary_dim)
    assert getattr(rotary, name)(query, key, cos, sin, rotary_dim) is True
    report = _compare(torch.cat([query, key], dim=1), torch.cat([expected_query, expected_key], dim=1), dtype)
    if report["error"] is None and not torch.equal(qkv[:, 4 * head_dim:].view(tokens, 2, head_dim), key):
        report["error"] = "the key was not rotated in place"
    return report


# -- paged attention ---------------------------------------------------------------------------------
def _paged(seq_lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int, v_dim: int,
           block_size: int, dtype: torch.dtype, seed: int, latent: bool = False):
    randn, generator = _tensors(seed)
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
    value_cache = key_cache[..., :v_dim] if latent else randn(num_blocks, block_size, kv_heads, v_dim, dtype=dtype)
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
    from pluginfer.core import kernels

    query, key, value, key_cache, value_cache, _, _, _, slots = _paged([9, 5], [3, 5], 4, 1 if latent else 2, 24,
                                                                       12 if latent else 16, 4,
                                                                       getattr(torch, dtype), 4, latent)
    ours = (key_cache.clone(), None)
    ours = (ours[0], ours[0][..., :12] if latent else value_cache.clone())
    write_kv.write_kv(key, value, ours[0], ours[1], slots)
    kernels.write_kv(key, value, key_cache, value_cache, slots)
    report = _compare(ours[0], key_cache, dtype)
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
    from pluginfer.core import kernels

    seq_lens, query_lens, heads, kv_heads, head_dim, v_dim, block_size = DECODE_SHAPES[shape]
    if latent:
        kv_heads = 1
    query, _, _, key_cache, value_cache, tables, _, lens, _ = _paged(seq_lens, query_lens, heads, kv_heads, head_dim,
                                                                     v_dim, block_size, getattr(torch, dtype), 5,
                                                                     latent)
    scale = head_dim ** -0.5
    ours = decode_attention.decode_attention(query, key_cache, value_cache, tables, lens, scale, window, cap,
                                             keys_per_split=keys_per_split)
    expected = kernels.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, window, cap)
    return _compare(ours, expected, dtype)


def case_prefill(dtype: str, shape: str, window: int | None, cap: float | None, latent: bool = False) -> dict:
    from pluginfer.backends.triton_kernels import prefill_attention
    from pluginfer.core import kernels

    seq_lens, query_lens, heads, kv_heads, head_dim, v_dim, block_size = PREFILL_SHAPES[shape]
    if latent:
        kv_heads = 1
    query, _, _, key_cache, value_cache, tables, starts, lens, _ = _paged(
        seq_lens, query_lens, heads, kv_heads, head_dim, v_dim, block_size, getattr(torch, dtype), 6, latent)
    scale = head_dim ** -0.5
    arguments = (query, key_cache, value_cache, tables, starts, lens, max(query_lens), scale, window, cap)
    return _compare(prefill_attention.paged_prefill_attention(*arguments),
                    kernels.paged_prefill_attention(*arguments), dtype)


def case_marlin_via_table(dtype: str, zero_points: bool) -> dict:
    from pluginfer.backends.triton_kernels import marlin_matmul
    from pluginfer.core import quant_kernels
    from pluginfer.quant import marlin_layout as layout

    randn, generator = _tensors(7)
    size_k, size_n, group_size = 256, 128, 128
    codes = torch.randint(0, 16, (size_k, size_n), generator=generator, dtype=torch.int32)
    packed, scales = layout.pack(codes, torch.rand(2, size_n, generator=generator) * 0.02 + 0.005, group_size)
    zeros = layout.pack_zero_points(torch.randint(0, 16, (2, size_n), generator=generator,
                                                  dtype=torch.int32)) if zero_points else None
    x = randn(3, size_k, dtype=getattr(torch, dtype))
    arguments = (x, packed, scales.to(x.dtype), group_size, zeros, None, layout.position_table(x.device))
    return _compare(marlin_matmul.marlin_matmul(*arguments), quant_kernels.marlin_matmul(*arguments), dtype)


# name: (tokens, experts, top_k, hidden, intermediate): the tiny Mixtral, Qwen3-MoE and DeepSeek models' experts.
MOE_SHAPES = {"mixtral": (7, 4, 2, 64, 128), "qwen3-moe": (5, 8, 2, 64, 64), "deepseek-v2-lite": (9, 6, 2, 64, 24),
              "deepseek-top3-decode": (1, 8, 3, 64, 48)}


def case_fused_moe(dtype: str, shape: str, activation: str, one_expert: bool = False) -> dict:
    from pluginfer.backends.triton_kernels import fused_moe
    from pluginfer.core import kernels

    randn, generator = _tensors(9)
    tokens, experts, top_k, hidden_size, inter = MOE_SHAPES[shape]
    kind = getattr(torch, dtype)
    hidden = randn(tokens, hidden_size, dtype=kind)
    gate_up, down = (randn(experts, 2 * inter, hidden_size) * 0.2).to(kind), (randn(experts, hidden_size, inter) * 0.2).to(kind)
    logits = randn(tokens, experts)
    if one_expert:  # every token's first choice is expert 1: one long run, other experts empty
        logits[:, 1] += 100.0
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    arguments = (hidden, gate_up, down, weights, ids, activation)
    ours, expected = fused_moe.fused_moe(*arguments), kernels.fused_moe(*arguments)
    # bf16: three truncations (gate/up, activation, down) put a few outputs ~4 ulps off; measured 1.4-1.7 %.
    return _compare_truncated(ours, expected, 3e-2) if dtype == "bfloat16" else _compare(ours, expected, dtype)


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


def case_grouped(dtype: str, bits: int, act_order: bool) -> dict:
    """GPTQ's packing (and AWQ's, repacked into it): the kernel, the table's reference, and the quant
    method's own dequantization (``packing.dequantize_grouped``) times x."""
    from pluginfer.backends.triton_kernels import grouped_matmul
    from pluginfer.core import quant_kernels
    from pluginfer.quant.packing import dequantize_grouped, pack_int32

    randn, generator = _tensors(10)
    size_k, size_n, group_size = 128, 96, 32
    groups, levels = size_k // group_size, 1 << bits
    codes = torch.randint(0, levels, (size_k, size_n), generator=generator, dtype=torch.int32)
    zeros = torch.randint(0, levels, (groups, size_n), generator=generator, dtype=torch.int32)
    scales = (torch.rand(groups, size_n, generator=generator) * 0.02 + 0.005).half()
    g_idx = (torch.randperm(size_k, generator=generator) // group_size).int() if act_order else None
    x = randn(3, size_k, dtype=getattr(torch, dtype))
    arguments = (x, pack_int32(codes, bits, dim=0), pack_int32(zeros, bits, dim=1), scales, g_idx, bits, group_size,
                 randn(size_n, dtype=x.dtype))
    expected = quant_kernels.grouped_matmul(*arguments)
    groups_of = g_idx if g_idx is not None else torch.arange(size_k) // group_size
    dense = dequantize_grouped(codes, zeros, scales, groups_of, x.dtype)
    layer_path = (x.float() @ dense.float().t()).to(x.dtype) + arguments[-1]
    ours = grouped_matmul.grouped_matmul(*arguments)
    report = _compare_truncated(ours, expected, 1e-2) if dtype == "bfloat16" else _compare(ours, expected, dtype)
    if report["error"] is None and not torch.equal(expected, layer_path):
        report["error"] = "the reference differs from dequantize_grouped"
    return report


def case_int8(dtype: str) -> dict:
    from pluginfer.backends.triton_kernels import int8_matmul
    from pluginfer.core import quant_kernels
    from pluginfer.quant.int8 import quantize_int8

    randn, _ = _tensors(11)
    q, scale = quantize_int8(randn(80, 96))
    x = randn(2, 3, 96, dtype=getattr(torch, dtype))
    arguments = (x, q, scale, randn(80, dtype=x.dtype))
    ours, expected = int8_matmul.int8_matmul(*arguments), quant_kernels.int8_matmul(*arguments)
    return _compare_truncated(ours, expected, 1e-2) if dtype == "bfloat16" else _compare(ours, expected, dtype)


def case_ggml(dtype: str, qtype_name: str, rows: int = 5, outputs: int = 72, cols: int = 128) -> dict:
    """Q8_0 / Q4_0 / Q4_K / Q6_K bytes from the quant methods' quantizer: the kernel, the table's reference,
    and ``ggml_blocks.dequantize`` (the GGUF method's torch path) times x."""
    from gguf import GGMLQuantizationType

    from pluginfer.backends.triton_kernels import ggml_k_matmul, ggml_matmul
    from pluginfer.core import kernels
    from pluginfer.quant import ggml_blocks, ggml_quantize

    randn, _ = _tensors(12)
    qtype = GGMLQuantizationType[qtype_name.upper()]
    raw = ggml_quantize.quantize(randn(outputs, cols), qtype)
    x = randn(rows, cols, dtype=getattr(torch, dtype))
    name = f"ggml_{qtype_name}_matmul"
    expected = getattr(kernels, name)(x, raw, cols, None)
    ours = getattr(ggml_k_matmul if qtype_name.endswith("_k") else ggml_matmul, name)(x, raw, cols, None)
    report = _compare_truncated(ours, expected, 1e-2) if dtype == "bfloat16" else _compare(ours, expected, dtype)
    layer_path = (x.float() @ ggml_blocks.dequantize(raw, qtype, cols, x.dtype).float().t()).to(x.dtype)
    if report["error"] is None and not torch.equal(expected, layer_path):
        report["error"] = "the reference differs from ggml_blocks.dequantize"
    return report


def case_backend(dtype: str, latent: bool) -> dict:
    """CudaBackend end to end on one mixed step (decodes, a chunk over cached blocks, a fresh prompt), against
    the cpu backend; then ``copy_blocks`` and the latent cache's value view."""
    from pluginfer.backends import cpu, cuda
    from pluginfer.core.protocols import KVCacheSpec
    from tests.backends.paged import paged_batch

    kind = getattr(torch, dtype)
    randn, _ = _tensors(8)
    backend, reference = cuda.CudaBackend(device=torch.device("cpu")), cpu.CpuBackend()
    reference.native_kernels = False
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1 if latent else 2, head_dim=24, v_head_dim=24,
                       value_in_key=16 if latent else None)
    caches = backend.allocate_kv_cache(spec, 24, 4, kind)
    expected_caches = reference.allocate_kv_cache(spec, 24, 4, kind)
    if latent and caches[0][1].data_ptr() != caches[0][0].data_ptr():
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
        report = _compare(ours, expected, dtype)
        if report["error"]:
            return report
        seq_lens = [n + 1 for n in seq_lens]
        query_lens = [1, 1, 1, 1]
    backend.copy_blocks(caches, [(3, 11)])
    if not torch.equal(caches[0][0][11], caches[0][0][3]) or not torch.equal(caches[0][1][11], caches[0][1][3]):
        report["error"] = "copy_blocks did not copy block 3 to 11"
    return report


CASES: dict[str, tuple] = {}
for _dtype in ("float32", "bfloat16", "float16"):
    CASES |= {
        f"rms_norm-{_dtype}": (case_rms_norm, _dtype, False, 0.0),
        f"rms_norm-residual-{_dtype}": (case_rms_norm, _dtype, True, 0.0),
        f"rms_norm-residual-offset-{_dtype}": (case_rms_norm, _dtype, True, 1.0),
        f"silu_and_mul-{_dtype}": (case_gated, _dtype, "silu"),
        f"gelu_and_mul-{_dtype}": (case_gated, _dtype, "gelu"),
        f"gelu_tanh_and_mul-{_dtype}": (case_gated, _dtype, "gelu_tanh"),
        f"rotary-neox-{_dtype}": (case_rotary, _dtype, True, 32),
        f"rotary-neox-partial-{_dtype}": (case_rotary, _dtype, True, 16),
        f"rotary-interleaved-partial-{_dtype}": (case_rotary, _dtype, False, 16),
        f"write_kv-{_dtype}": (case_write_kv, _dtype, False),
        f"decode-gqa-{_dtype}": (case_decode, _dtype, "gqa", None, None, 256),
        f"prefill-chunk-and-prefix-hit-{_dtype}": (case_prefill, _dtype, "chunk-and-prefix-hit", None, None),
        f"fused_moe-mixtral-{_dtype}": (case_fused_moe, _dtype, "mixtral", "silu"),
        f"grouped-4bit-{_dtype}": (case_grouped, _dtype, 4, False),
        f"int8-{_dtype}": (case_int8, _dtype),
        f"ggml-q8_0-{_dtype}": (case_ggml, _dtype, "q8_0"),
        f"ggml-q4_0-{_dtype}": (case_ggml, _dtype, "q4_0"),
    }
CASES |= {
    "rotary-interleaved-full-float32": (case_rotary, "float32", False, 32),
    "write_kv-latent-float32": (case_write_kv, "float32", True),
    "decode-gqa-split-16-float32": (case_decode, "float32", "gqa", None, None, 16),
    "decode-gqa-split-16-window-softcap-float32": (case_decode, "float32", "gqa", 7, 2.5, 16),
    "decode-gqa-window-float32": (case_decode, "float32", "gqa", 5, None, 256),
    "decode-gqa-softcap-float32": (case_decode, "float32", "gqa", None, 3.0, 256),
    "decode-mha-block16-split-16-float32": (case_decode, "float32", "mha-block16", None, None, 16),
    "decode-mqa-vdim-float32": (case_decode, "float32", "mqa-vdim", None, None, 256),
    "decode-latent-float32": (case_decode, "float32", "mqa-vdim", None, None, 16, True),
    "decode-gqa-split-16-window-bfloat16": (case_decode, "bfloat16", "gqa", 9, None, 16),
    "prefill-fresh-prompts-float32": (case_prefill, "float32", "fresh-prompts", None, None),
    "prefill-chunk-and-prefix-hit-window-float32": (case_prefill, "float32", "chunk-and-prefix-hit", 6, None),
    "prefill-chunk-and-prefix-hit-softcap-float32": (case_prefill, "float32", "chunk-and-prefix-hit", None, 2.0),
    "prefill-chunk-and-prefix-hit-window-softcap-bfloat16": (case_prefill, "bfloat16", "chunk-and-prefix-hit", 6,
                                                             2.0),
    "prefill-mha-vdim-float32": (case_prefill, "float32", "mha-vdim", None, None),
    "prefill-latent-float32": (case_prefill, "float32", "chunk-and-prefix-hit", None, None, True),
    "marlin-float32": (case_marlin_via_table, "float32", False),
    "backend-float32": (case_backend, "float32", False),
    "backend-latent-float32": (case_backend, "float32", True),
    "backend-bfloat16": (case_backend, "bfloat16", False),
    "marlin-zero-points-float16": (case_marlin_via_table, "float16", True),
    "fused_moe-qwen3-moe-float32": (case_fused_moe, "float32", "qwen3-moe", "silu"),
    "fused_moe-deepseek-v2-lite-float32": (case_fused_moe, "float32", "deepseek-v2-lite", "silu"),
    "fused_moe-deepseek-top3-decode-bfloat16": (case_fused_moe, "bfloat16", "deepseek-top3-decode", "silu"),
    "fused_moe-one-expert-gelu-tanh-float32": (case_fused_moe, "float32", "qwen3-moe", "gelu_tanh", True),
    "fused_moe-gelu-float16": (case_fused_moe, "float16", "deepseek-v2-lite", "gelu"),
    "fused_moe-align-by-expert": (case_align_by_expert,),
    "grouped-4bit-act-order-float32": (case_grouped, "float32", 4, True),
    "grouped-8bit-float32": (case_grouped, "float32", 8, False),
    "grouped-8bit-act-order-float16": (case_grouped, "float16", 8, True),
}
for _qtype in ("q4_k", "q6_k"):  # three super-blocks per row, an odd output count, one row and several
    CASES |= {f"ggml-{_qtype}-rows-{_rows}-{_dtype}": (case_ggml, _dtype, _qtype, _rows, 67, 768)
              for _rows in (1, 5) for _dtype in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def reports() -> dict:
    """Every case in one interpreter process (each start imports torch and triton anew)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton; the test extra has it)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path.cwd()))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_equals_its_reference(reports: dict, name: str) -> None:
    report = reports[name]
    assert report["error"] is None, f"{name}: {report['error']}"


# Ops the cuda backend leaves to the table's reference on purpose: cuBLAS reads the checkpoint's [out, in] layout.
REFERENCE_ON_CUDA = {"dense_layout", "dense_pack", "dense_linear"}


def test_every_op_but_none_has_a_triton_kernel() -> None:
    """The cuda backend's table covers every op of core/kernels.py but the dense layouts (cuBLAS)."""
    from pluginfer.core import kernels

    done = subprocess.run([sys.executable, "-c", "from pluginfer.core.kernels import KernelTable; "
                           "from pluginfer.backends import triton_kernels; t = KernelTable('cuda'); "
                           "triton_kernels.register(t); print(','.join(t.names()))"],
                          env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert set(done.stdout.strip().split(",")) == set(kernels.OPS) - REFERENCE_ON_CUDA


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for case_name, (function, *arguments) in CASES.items():
        try:
            results[case_name] = function(*arguments)
        except Exception as exc:  # one broken kernel must not hide the others' results
            results[case_name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results))
