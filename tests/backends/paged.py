"""Paged-cache test inputs: a hand-built ForwardBatch over given block tables, as the runner would flatten one
step; random caches in shuffled blocks, and the float64 decode attention they are checked against."""

from __future__ import annotations

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.testing import backend_contract


def paged_batch(backend: object, tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                block_size: int) -> ForwardBatch:
    """Each sequence's last ``query_len`` tokens computed this step; attention metadata prepared."""
    batch = backend_contract.paged_batch(torch.device("cpu"), tables, seq_lens, query_lens, block_size)
    batch.attention = backend.prepare(batch)
    return batch


def attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        tables: torch.Tensor, seq_lens: list[int], scale: float, window: int | None = None,
                        soft_cap: float | None = None) -> torch.Tensor:
    """Gather each sequence's keys and values from its blocks; softmax attention in float64 (IEEE: a NaN
    score gives NaN probabilities, +inf - +inf is NaN, a -inf score weighs 0)."""
    _, block_size, kv_heads, head_dim = key_cache.shape
    heads, v_dim = query.shape[1], value_cache.shape[-1]
    outputs = []
    for s, length in enumerate(seq_lens):
        positions = torch.arange(max(0, length - window) if window else 0, length)
        slots = tables[s, positions // block_size] * block_size + positions % block_size
        keys = key_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        values = value_cache.reshape(-1, kv_heads, v_dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", query[s].double(), keys) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        outputs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values))
    return torch.stack(outputs)


def paged_inputs(seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, v_dim: int, block_size: int = 16,
                 seed: int = 0) -> tuple[torch.Tensor, ...]:
    """query, key cache, value cache, block tables: blocks in random order, unused blocks full of garbage."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(seed)
    per_seq = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * per_seq + 2
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, v_dim, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * per_seq].reshape(len(seq_lens), -1)
    query = 2 * torch.randn(len(seq_lens), heads, head_dim, generator=generator)
    return query, key_cache, value_cache, tables
