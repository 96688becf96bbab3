"""A hand-built ForwardBatch over given block tables, as the runner would flatten one step."""

from __future__ import annotations

import torch

from pluginfer.core.batch import ForwardBatch


def paged_batch(backend: object, tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                block_size: int) -> ForwardBatch:
    """Each sequence's last ``query_len`` tokens computed this step; attention metadata prepared."""
    block_tables = torch.zeros(len(seq_lens), max(map(len, tables)), dtype=torch.int64)
    for row, blocks in enumerate(tables):
        block_tables[row, : len(blocks)] = torch.tensor(blocks)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)])
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    batch = ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64), positions=positions,
        slot_mapping=block_tables[rows, positions // block_size] * block_size + positions % block_size,
        query_start_loc=starts, seq_lens=torch.tensor(seq_lens), block_tables=block_tables,
        logits_indices=starts[1:] - 1, query_lens=list(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_size=block_size)
    batch.attention = backend.prepare(batch)
    return batch
