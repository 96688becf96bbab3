"""Bidirectional attention of an encoder: every token attends to every token of its own sequence.

An encoder (BERT, XLM-RoBERTa) reads each sequence whole in one step and keeps no KV cache, so this
layer does not go through the backend's paged kernel (which is causal). The flat batch is scattered
into ``[sequences, longest, heads, head_dim]`` once per step (the index is kept in ``batch.extras``),
attended with one ``scaled_dot_product_attention`` call under a key-padding mask, and gathered back.
``window`` (ModernBERT's local layers): a token sees only the tokens at most ``window`` positions away.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from pluginfer.core.batch import ForwardBatch

_INDEX_KEY = "encoder_attention_index"


def padded_index(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence of each token, its offset in the sequence, key mask ``[seqs, 1, 1, longest]``), once a step.

    Raises RuntimeError if a sequence is not whole in this step (its keys would be missing)."""
    if _INDEX_KEY not in batch.extras:
        lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
        if batch.max_seq_len != batch.max_query_len or not torch.equal(lens, batch.seq_lens):
            raise RuntimeError("an encoder reads every sequence whole in one step; this step holds part of one")
        device = batch.input_ids.device
        seq_of = torch.repeat_interleave(torch.arange(batch.num_seqs, device=device), lens)
        offset = torch.arange(batch.num_tokens, device=device) - batch.query_start_loc[seq_of]
        mask = torch.arange(batch.max_query_len, device=device)[None, :] < lens[:, None]
        batch.extras[_INDEX_KEY] = (seq_of, offset, mask[:, None, None, :])
    return batch.extras[_INDEX_KEY]


def _windowed(batch: ForwardBatch, mask: torch.Tensor, window: int) -> torch.Tensor:
    """The key mask narrowed to a band of ``window`` positions each side (``[seqs, 1, longest, longest]``)."""
    key = (_INDEX_KEY, window)
    if key not in batch.extras:
        positions = torch.arange(batch.max_query_len, device=mask.device)
        band = (positions[:, None] - positions[None, :]).abs() <= window
        batch.extras[key] = mask & band
    return batch.extras[key]


class EncoderAttention(nn.Module):
    """``softmax(q k^T * scale) v`` within each sequence, for ``[tokens, heads, head_dim]`` q, k, v."""

    def __init__(self, num_heads: int, head_dim: int, scale: float | None = None, window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.window = num_heads, head_dim, window
        self.scale = head_dim**-0.5 if scale is None else scale

    def forward(self, batch: ForwardBatch, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        seq_of, offset, mask = padded_index(batch)
        if self.window is not None and self.window < batch.max_query_len:
            mask = _windowed(batch, mask, self.window)
        shape = (batch.num_seqs, batch.max_query_len, self.num_heads, self.head_dim)

        def padded(x: torch.Tensor) -> torch.Tensor:  # [seqs, heads, longest, head_dim]
            out = x.new_zeros(shape)
            out[seq_of, offset] = x
            return out.transpose(1, 2)

        out = scaled_dot_product_attention(padded(query), padded(key), padded(value), attn_mask=mask,
                                           scale=self.scale)
        return out.transpose(1, 2)[seq_of, offset].reshape(query.shape[0], -1)
