"""Paged attention's kernel ops (``write_kv``, ``paged_decode_attention``, ``paged_prefill_attention``) with
their torch references, and ``DeviceBackend.paged_attention`` built from a backend's ``KernelTable``.

The references are defined as ops of the core's open table (``pluginfer.core.kernels.define_op``) as in
``ops.py``. Paged caches are ``[num_blocks, block_size, kv_heads, dim]``; a value cache may be a view of the key
cache's last features (multi-head latent attention, ``core.kv_layout.value_in_key``), which every op reads as it is. A quantized cache (int8,
float8) is ``[..., dim + 4]``: each row's codes and its float32 scale (``layers/kv_quant.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.kernels import KernelTable, define_op
from pluginfer.layers import kv_quant


# -- paged KV cache and attention --------------------------------------------------------------------
def write_kv(key: torch.Tensor, value: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store token ``t``'s ``key[t]`` (``[tokens, kv_heads, dim]``) at cache slot ``slot_mapping[t]``
    (``block * block_size + offset``), and its value unless ``value`` is None (a value inside the key).
    A quantized cache (``layers/kv_quant.py``) gets each row's codes and its own scale."""
    if kv_quant.is_quantized(key_cache.dtype):
        kv_quant.write_rows(key_cache, slot_mapping, key)
        if value is not None:
            kv_quant.write_rows(value_cache, slot_mapping, value)
        return
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    if value is not None:
        value_cache.flatten(0, 1).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _attend_one(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor,
                scale: float, sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """float32 attention of ``[q, heads, dim]`` over one sequence's ``[n, kv_heads, dim]`` keys."""
    groups = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(groups, dim=1)
    values = values.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    key_positions = torch.arange(keys.shape[0], device=query.device)
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed = allowed & (key_positions[None, :] > query_positions[:, None] - sliding_window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first ``length`` cached rows ``[length, kv_heads, dim]`` (a quantized cache's dequantized)."""
    positions = torch.arange(length, device=cache.device)
    rows = cache[table[positions // cache.shape[1]], positions % cache.shape[1]]
    return kv_quant.dequantize(rows) if kv_quant.is_quantized(cache.dtype) else rows


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """One query token per sequence: ``query`` ``[seqs, heads, dim]`` at position ``seq_lens[i] - 1``
    attends over the sequence's ``seq_lens[i]`` cached keys (``block_tables[i]`` names its blocks).

    GQA: query head ``h`` reads KV head ``h // (heads / kv_heads)``. ``sliding_window``: only keys at
    positions ``> position - sliding_window``. ``soft_cap``: scores become ``cap * tanh(score / cap)``
    before the softmax. Returns ``[seqs, heads, v_dim]`` in the query's dtype.
    """
    starts = torch.arange(seq_lens.shape[0] + 1, device=query.device)
    return paged_prefill_attention(query, key_cache, value_cache, block_tables, starts, seq_lens, 1, scale,
                                   sliding_window, soft_cap)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            max_query_len: int, scale: float, sliding_window: int | None,
                            soft_cap: float | None) -> torch.Tensor:
    """Any number of query tokens per sequence, over the paged cache (chunked prefill, prefix-cache hits).

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i + 1]`` (at most
    ``max_query_len``): its last positions, whose keys are already in the cache. Causal within the
    sequence; GQA, sliding window and soft cap as :func:`paged_decode_attention`. Returns
    ``[tokens, heads, v_dim]`` in the query's dtype.
    """
    out = query.new_zeros(query.shape[0], query.shape[1], kv_quant.feature_dim(value_cache))
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    for i, length in enumerate(lengths):
        rows = slice(starts[i], starts[i + 1])
        count = starts[i + 1] - starts[i]
        keys = _gather(key_cache, block_tables[i], length)
        values = _gather(value_cache, block_tables[i], length)
        positions = torch.arange(length - count, length, device=query.device)
        out[rows] = _attend_one(query[rows], keys, values, positions, scale, sliding_window, soft_cap).to(out.dtype)
    return out


for _reference in (write_kv, paged_decode_attention, paged_prefill_attention):
    define_op(_reference)


# -- a backend's paged attention through its table ---------------------------------------------------
@dataclass
class PagedAttentionMetadata:
    """One step's batch split for the attention ops: the leading one-token sequences decode, the rest prefill."""

    num_decodes: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    prefill_starts: torch.Tensor  # query_start_loc of the prefill sequences, from 0
    prefill_max_query_len: int


def paged_attention_metadata(batch: ForwardBatch) -> PagedAttentionMetadata:
    """Built once per step (``DeviceBackend.prepare``) from host integers: no device synchronisation."""
    num_decodes = next((i for i, n in enumerate(batch.query_lens) if n != 1), len(batch.query_lens))
    prefill_lens = batch.query_lens[num_decodes:]
    return PagedAttentionMetadata(num_decodes, batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc[num_decodes:] - num_decodes, max(prefill_lens, default=0))


def paged_attention(kernels: KernelTable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, scale: float,
                    sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """``DeviceBackend.paged_attention`` from the table's ``write_kv``, ``paged_decode_attention`` and
    ``paged_prefill_attention`` (``batch.attention`` is a :class:`PagedAttentionMetadata`)."""
    key_cache, value_cache = kv_cache
    meta: PagedAttentionMetadata = batch.attention
    key_scales, value_scales = kv_quant.fixed_scales(kv_cache)
    if key_scales is not None:  # a checkpoint's scales: the reference write (no op takes them)
        kv_quant.write_rows(key_cache, batch.slot_mapping, key, key_scales)
        if value is not None:
            kv_quant.write_rows(value_cache, batch.slot_mapping, value, value_scales)
    else:
        kernels.get("write_kv")(key, value, key_cache, value_cache, batch.slot_mapping)
    decodes = meta.num_decodes
    if decodes == query.shape[0]:
        return kernels.get("paged_decode_attention")(query, key_cache, value_cache, meta.block_tables,
                                                     meta.seq_lens, scale, sliding_window, soft_cap)
    out = query.new_empty(query.shape[0], query.shape[1], kv_quant.feature_dim(value_cache))
    if decodes:
        out[:decodes] = kernels.get("paged_decode_attention")(
            query[:decodes], key_cache, value_cache, meta.block_tables[:decodes], meta.seq_lens[:decodes], scale,
            sliding_window, soft_cap)
    out[decodes:] = kernels.get("paged_prefill_attention")(
        query[decodes:], key_cache, value_cache, meta.block_tables[decodes:], meta.prefill_starts,
        meta.seq_lens[decodes:], meta.prefill_max_query_len, scale, sliding_window, soft_cap)
    return out
