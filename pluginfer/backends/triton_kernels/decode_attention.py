"""Paged attention for one query token per sequence, split over the context (op ``paged_decode_attention``).

Stage one: a program per (sequence, KV head, block of its query heads, split of the context) reads the
split's keys once for every query head of its GQA group (``tl.dot`` over ``[heads, dim] x [dim, keys]``,
head rows padded to 16), keeps an online softmax and writes its partial output and log-sum-exp. Stage two
weighs the splits by their log-sum-exp. A short context runs as one split and skips stage two. Multi-head
latent attention is the case of one KV head whose value is a view of the key: every query head shares it.
A quantized cache (``kv_codes.py``) is read as bytes, widened in registers; each key's scale multiplies its
scores, each value's scale its softmax weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.backends.triton_kernels import dot_in_float32, kv_codes

# a split's keys: long contexts fan out over several programs per head
KEYS_PER_SPLIT = 256
MAX_SPLITS = 32
BLOCK_N = 16


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
    stride_ts, stride_tb,
    stride_os, stride_oh, stride_op, stride_od,
    stride_ls, stride_lh, stride_lp,
    scale, soft_cap, sliding_window, block_size, keys_per_split, head_dim, v_dim, group, head_blocks,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, DOT_FP32: tl.constexpr, KIND: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // head_blocks
    head_block = tl.program_id(1) % head_blocks
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)
    if HAS_WINDOW:
        # the query sits at seq_len - 1 and sees positions > seq_len - 1 - window
        start = tl.maximum(start, seq_len - sliding_window)
    in_group = head_block * BLOCK_G + tl.arange(0, BLOCK_G)
    head_mask = in_group < group
    heads = kv_head * group + in_group
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=head_mask[:, None] & (d[None, :] < head_dim), other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), dtype=tl.float32)
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
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
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
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_op + dv[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & (dv[None, :] < v_dim))
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split * stride_lp, lse, mask=head_mask)


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, stride_ps, stride_ph, stride_pp, stride_pd,
                    stride_ls, stride_lh, stride_lp, stride_os, stride_oh, stride_od, num_splits, v_dim,
                    BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + p * stride_lp, mask=p < num_splits,
                  other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))
    weights = weights / tl.sum(weights, axis=0)
    parts = tl.load(part_ptr + seq * stride_ps + head * stride_ph + p[:, None] * stride_pp + dv[None, :] * stride_pd,
                    mask=(p[:, None] < num_splits) & (dv[None, :] < v_dim), other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dv * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=dv < v_dim)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                     soft_cap: float | None, keys_per_split: int = KEYS_PER_SPLIT) -> torch.Tensor:
    """``paged_decode_attention`` with the split size as a knob (tests split short contexts)."""
    seqs, heads, head_dim = query.shape
    key_data, key_scales, _ = kv_codes.views(key_cache)
    value_data, value_scales, v_dim = kv_codes.views(value_cache)
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty(seqs, heads, v_dim, dtype=query.dtype, device=query.device)
    if seqs == 0:
        return out
    # The widest block table bounds every context in the batch: split counts need no device read.
    max_keys = block_tables.shape[1] * block_size
    keys_per_split = max(triton.cdiv(max_keys, MAX_SPLITS), keys_per_split)
    keys_per_split = triton.cdiv(keys_per_split, BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(max_keys, keys_per_split)
    block_g = min(max(16, triton.next_power_of_2(group)), 64)
    head_blocks = triton.cdiv(group, block_g)
    lse = torch.empty(seqs, heads, num_splits, dtype=torch.float32, device=query.device)
    kind = kv_codes.kind(key_cache)
    if num_splits == 1:
        parts, part_strides = out, (out.stride(0), out.stride(1), 0, out.stride(2))
    else:
        parts = torch.empty(seqs, heads, num_splits, v_dim, dtype=torch.float32, device=query.device)
        part_strides = parts.stride()
    _decode_split_kernel[(seqs, kv_heads * head_blocks, num_splits)](
        query, key_data, value_data, key_scales, value_scales, block_tables, seq_lens, parts, lse,
        *query.stride(), *key_data.stride(), *value_data.stride(), *kv_codes.scale_strides(key_scales),
        *kv_codes.scale_strides(value_scales), *block_tables.stride(), *part_strides, *lse.stride(),
        scale, soft_cap or 0.0, sliding_window or 0, block_size, keys_per_split, head_dim, v_dim, group, head_blocks,
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=soft_cap is not None,
        DOT_FP32=dot_in_float32(key_cache.dtype if kind == 0 else query.dtype), KIND=kind,
        BLOCK_G=block_g, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(v_dim)),
    )
    if num_splits > 1:
        _combine_kernel[(seqs, heads)](parts, lse, out, *parts.stride(), *lse.stride(), *out.stride(), num_splits,
                                       v_dim, BLOCK_P=triton.next_power_of_2(num_splits),
                                       BLOCK_DV=triton.next_power_of_2(v_dim))
    return out


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    return decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
