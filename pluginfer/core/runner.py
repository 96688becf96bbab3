"""ModelRunner: scheduled sequences -> one flat ForwardBatch -> pipeline.forward -> logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pluginfer.core.batch import ForwardBatch

if TYPE_CHECKING:
    from pluginfer.core.protocols import DeviceBackend, ModelPipeline
    from pluginfer.core.scheduler import ScheduledSequence


class ModelRunner:
    """Owns the pipeline and its KV cache tensors on one rank."""

    def __init__(self, pipeline: ModelPipeline, backend: DeviceBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        self.pipeline, self.backend, self.block_size = pipeline, backend, block_size
        self.kv_caches = kv_caches
        layers = [m for m in pipeline.modules() if hasattr(m, "kv_cache") and hasattr(m, "backend")]
        if len(layers) != len(kv_caches):
            raise RuntimeError(f"pipeline has {len(layers)} attention layers but {len(kv_caches)} caches")
        for layer, cache in zip(layers, kv_caches):
            layer.kv_cache = cache

    def build_batch(self, scheduled: list[ScheduledSequence]) -> ForwardBatch:
        """Flatten the step: tokens, positions, cache slots and block tables of every sequence."""
        block_size = self.block_size
        starts = np.fromiter((s.seq.num_computed_tokens for s in scheduled), np.int64, len(scheduled))
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, len(scheduled))
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(len(scheduled) + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        if int(query_lens.max()) == 1:  # decode-only: one token per sequence, no concatenation
            input_ids = np.fromiter((s.seq.last_token_id for s in scheduled), np.int64, len(scheduled))
            positions = starts
        else:
            input_ids = np.concatenate([
                np.asarray(s.seq.token_slice(int(a), int(a + n)), np.int64)
                for s, a, n in zip(scheduled, starts, query_lens)])
            positions = np.repeat(starts - query_start_loc[:-1], query_lens) + np.arange(query_start_loc[-1])
        max_blocks = int(-(-seq_lens.max() // block_size))
        tables = np.zeros((len(scheduled), max_blocks), np.int64)
        for row, s in enumerate(scheduled):
            table = s.seq.block_table[:max_blocks]
            tables[row, : len(table)] = table
        token_rows = np.repeat(np.arange(len(scheduled)), query_lens)
        slot_mapping = tables[token_rows, positions // block_size] * block_size + positions % block_size
        sampling = [row for row, s in enumerate(scheduled) if s.sample_for]
        logits_rows = query_start_loc[1:][sampling] - 1
        prompt_rows = self._prompt_logprob_rows(scheduled, starts, query_lens, query_start_loc)
        if prompt_rows:
            logits_rows = np.concatenate([logits_rows] + [np.arange(r, r + n) for _, _, r, n in prompt_rows])
        batch = ForwardBatch(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(np.ascontiguousarray(positions)),
            slot_mapping=torch.from_numpy(slot_mapping),
            query_start_loc=torch.from_numpy(query_start_loc),
            seq_lens=torch.from_numpy(seq_lens),
            block_tables=torch.from_numpy(tables),
            logits_indices=torch.from_numpy(np.ascontiguousarray(logits_rows)),
            query_lens=query_lens.tolist(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=block_size,
        )
        batch.extras["prompt_logprob_rows"] = [(seq, first, n) for seq, first, _, n in prompt_rows]
        batch.attention = self.backend.prepare(batch)
        return batch

    @staticmethod
    def _prompt_logprob_rows(scheduled: list[ScheduledSequence], starts: np.ndarray, query_lens: np.ndarray,
                             query_start_loc: np.ndarray) -> list[tuple]:
        """(seq, first position, flat row, count) for prompt chunks whose logprobs were asked for.

        Row ``first + i`` predicts prompt token ``first + i + 1``; the prompt's last position
        predicts the first generated token and belongs to sampling.
        """
        rows = []
        for index, item in enumerate(scheduled):
            seq = item.seq
            if seq.params.prompt_logprobs is None or seq.index != 0:
                continue
            first = int(starts[index])
            count = min(first + int(query_lens[index]), seq.num_prompt_tokens - 1) - first
            if count > 0 and len(seq.prompt_logprobs) <= first + 1:  # not again after a recompute
                rows.append((seq, first, int(query_start_loc[index]), count))
        return rows

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits for the rows in ``batch.logits_indices`` (empty if none samples)."""
        hidden = self.pipeline.forward(batch)
        if hidden.shape[0] == 0:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.pipeline.compute_logits(hidden)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.backend.copy_blocks(self.kv_caches, copies)
