"""Paged attention for several query tokens per sequence (op ``paged_prefill_attention``).

Reads every key from the paged cache, so a chunk of a long prompt or a prompt whose prefix was cached
attends to blocks written by earlier steps. A program per (sequence, query head, block of 16 query
rows) walks the keys from the window's start to its last row's position in blocks of 16 with an
online softmax; causal, sliding-window and padding masks are applied per score. A quantized cache
(``kv_codes.py``) is read as bytes and widened in registers: a key's scale multiplies its scores, a value's
its dequantized row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.backends.triton_kernels import dot_in_float32, kv_codes

BLOCK_M, BLOCK_N = 16, 16


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, starts_ptr, seq_lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
    stride_ts, stride_tb,
    stride_ot, stride_oh, stride_od,
    scale, soft_cap, sliding_window, block_size, head_dim, v_dim, group,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, DOT_FP32: tl.constexpr, KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row_block = tl.program_id(2)
    kv_head = head // group
    first_row = tl.load(starts_ptr + seq).to(tl.int64)
    query_len = (tl.load(starts_ptr + seq + 1) - first_row).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context = seq_len - query_len
    m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = m < query_len
    query_pos = context + m
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + (first_row + m)[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
                mask=row_valid[:, None] & (d[None, :] < head_dim), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    end = tl.minimum(seq_len, context + (row_block + 1) * BLOCK_M)  # the block's last row sees no further
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(context + row_block * BLOCK_M - sliding_window + 1, 0)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(tables_ptr + seq * stride_ts + (pos // block_size) * stride_tb, mask=valid, other=0)
        offset = pos % block_size
        k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko + kv_head * stride_kh
                    + d[None, :] * stride_kd, mask=valid[:, None] & (d[None, :] < head_dim), other=0)
        if KIND != 0:
            # codes widened (exact in the query's dtype too); the row's scale joins the score's
            k = kv_codes.widen(k, KIND)
            if not DOT_FP32:
                k = k.to(q.dtype)
        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q.to(k.dtype), tl.trans(k))
        if KIND != 0:
            k_scale = tl.load(ks_ptr + block * stride_ksb + offset * stride_kso + kv_head * stride_ksh, mask=valid,
                              other=0.0)
            scores = scores * (k_scale * (scale * kv_codes.wide_factor(KIND)))[None, :]
        else:
            scores = scores * scale
        if HAS_SOFT_CAP:
            scores = soft_cap * _tanh(scores / soft_cap)
        allowed = valid[None, :] & (pos[None, :] <= query_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to rescale
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo + kv_head * stride_vh
                    + dv[None, :] * stride_vd, mask=valid[:, None] & (dv[None, :] < v_dim), other=0)
        if KIND != 0:
            # values dequantized in registers (then rounded as a 16-bit cache's would be)
            v_scale = tl.load(vs_ptr + block * stride_vsb + offset * stride_vso + kv_head * stride_vsh, mask=valid,
                              other=0.0)
            v = kv_codes.widen(v, KIND) * (v_scale * kv_codes.wide_factor(KIND))[:, None]
            if not DOT_FP32:
                v = v.to(q.dtype)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (first_row + m)[:, None] * stride_ot + head * stride_oh + dv[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (dv[None, :] < v_dim))


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            max_query_len: int, scale: float, sliding_window: int | None,
                            soft_cap: float | None) -> torch.Tensor:
    tokens, heads, head_dim = query.shape
    key_data, key_scales, _ = kv_codes.views(key_cache)
    value_data, value_scales, v_dim = kv_codes.views(value_cache)
    kv_heads, kind = key_cache.shape[2], kv_codes.kind(key_cache)
    out = torch.zeros(tokens, heads, v_dim, dtype=query.dtype, device=query.device)
    seqs = seq_lens.shape[0]
    if seqs == 0 or tokens == 0:
        return out
    _prefill_kernel[(seqs, heads, triton.cdiv(max_query_len, BLOCK_M))](
        query, key_data, value_data, key_scales, value_scales, block_tables, query_start_loc, seq_lens, out,
        *query.stride(), *key_data.stride(), *value_data.stride(), *kv_codes.scale_strides(key_scales),
        *kv_codes.scale_strides(value_scales), *block_tables.stride(), *out.stride(),
        scale, soft_cap or 0.0, sliding_window or 0, key_cache.shape[1], head_dim, v_dim, heads // kv_heads,
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=soft_cap is not None,
        DOT_FP32=dot_in_float32(key_cache.dtype if kind == 0 else query.dtype), KIND=kind,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(v_dim)),
    )
    return out
