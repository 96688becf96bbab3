"""InputBatch: a worker's rows and block tables, kept between steps and updated from each ``StepData``.

The rows are the step's scheduled sequences in the scheduler's order (decodes first). A step removes the
rows that left, appends the blocks the held rows gained, adds the new rows with their tables, and the flat
arrays of the step (``ForwardBatch``'s, as numpy int64) are built from that state. When the step repeats
the last step's rows as a plain decode (``StepData.same_rows``), the last step's arrays are written over
in place: the same arrays, so the worker may hand its backend the same batch again.
"""

from __future__ import annotations

import numpy as np
import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.engine.step import StepData

_EMPTY = np.zeros(0, np.int64)


class InputBatch:
    """One worker's persistent batch; ``update`` applies a step, the attributes are that step's arrays."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seq_ids: list[int] = []  # row -> seq id
        # Every block each row holds, by row and by seq id (the same lists); lists, not numpy, since a decode
        # step reads one entry per row.
        self._blocks: list[list[int]] = []
        self._blocks_of: dict[int, list[int]] = {}
        self._plain_decode = False  # the arrays below are a plain decode step's over the rows
        self._multimodal_of: dict[int, object] = {}  # seq id -> its request's media inputs (rows that have them)
        self.input_ids = self.positions = self.slot_mapping = self.seq_lens = self.logits_indices = _EMPTY
        self.query_start_loc = np.zeros(1, np.int64)
        self.block_tables = np.zeros((0, 0), np.int64)  # [rows, blocks the longest row needs], 0-padded
        self.max_seq_len = 0
        self.num_hidden_rows = 0

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    @property
    def num_logits(self) -> int:
        return int(self.logits_indices.shape[0])

    def block_ids(self, seq_id: int) -> list[int]:
        """The blocks this worker holds for a row's sequence."""
        return list(self._blocks_of[seq_id])

    def update(self, data: StepData) -> bool:
        """Apply the step; True when the arrays are the last step's own, written over (same rows, a plain
        decode on both steps), False when they are new arrays."""
        if data.same_rows and self._plain_decode and data.is_plain_decode:
            return self._advance(data)
        self._apply_rows(data)
        self._build_arrays(data)
        return False

    # -- the rows --------------------------------------------------------------------------

    def _apply_rows(self, data: StepData) -> None:
        """Rows removed, put in the step's order, new ones added, held ones' new blocks appended."""
        held = {} if data.reset else self._blocks_of
        for seq_id in data.removed_ids:
            if held.pop(seq_id, None) is None:
                raise RuntimeError(f"step data removes sequence {seq_id}, which this worker does not hold")
        seq_ids = self.seq_ids if data.same_rows and not data.seq_ids else data.seq_ids
        if len(seq_ids) != data.num_rows:
            raise RuntimeError(f"step data names {len(seq_ids)} rows but gives {data.num_rows} rows' positions")
        if data.reset:
            self._multimodal_of = {}
        for seq_id in data.removed_ids:
            self._multimodal_of.pop(seq_id, None)
        for row in data.new_rows:
            held[row.seq_id] = list(row.block_ids)
            if row.multimodal is not None:
                self._multimodal_of[row.seq_id] = row.multimodal
        try:
            blocks = [held[seq_id] for seq_id in seq_ids]
        except KeyError as exc:
            raise RuntimeError(f"step data continues sequence {exc.args[0]}, which this worker does not hold") from None
        if len(held) != len(seq_ids):
            # a held row neither scheduled nor removed: the driver lost count
            stray = sorted(set(held) - set(seq_ids))
            raise RuntimeError(f"step data neither schedules nor removes held sequences {stray}")
        self.seq_ids, self._blocks, self._blocks_of = list(seq_ids), blocks, held
        self._grow(data.new_block_ids)

    def _grow(self, new_block_ids: list[tuple[int, list[int]]]) -> None:
        for seq_id, extra in new_block_ids:
            blocks = self._blocks_of.get(seq_id)
            if blocks is None:
                raise RuntimeError(f"step data gives new blocks to sequence {seq_id}, which this worker does not hold")
            blocks.extend(extra)

    def _tables(self, width: int) -> np.ndarray:
        """The rows' block tables cut (or 0-padded) to ``width`` blocks."""
        tables = np.zeros((len(self._blocks), width), np.int64)
        for row, blocks in enumerate(self._blocks):
            if blocks:
                tables[row, :len(blocks)] = blocks[:width]
        return tables

    # -- the step's arrays -----------------------------------------------------------------

    def _build_arrays(self, data: StepData) -> None:
        """The flat arrays of any step (prefill chunks, prompt logprobs and pooled rows included)."""
        count, block_size = data.num_rows, self.block_size
        starts = np.array(data.num_computed_tokens, np.int64)
        query_start_loc = np.zeros(count + 1, np.int64)
        if data.num_new_tokens is None:  # a decode step: one token per row
            query_lens = np.ones(count, np.int64)
            query_start_loc[1:] = np.arange(1, count + 1)
            positions = starts
        else:
            query_lens = np.array(data.num_new_tokens, np.int64)
            np.cumsum(query_lens, out=query_start_loc[1:])
            positions = np.repeat(starts - query_start_loc[:-1], query_lens) + np.arange(query_start_loc[-1])
        seq_lens = starts + query_lens
        longest = int(seq_lens.max()) if count else 0
        tables = self._tables(-(-longest // block_size))
        held = np.fromiter(map(len, self._blocks), np.int64, count) * block_size
        if (held < seq_lens).any():  # its slots would be read from the padding
            row = int(np.argmax(held < seq_lens))
            raise RuntimeError(f"step data: sequence {self.seq_ids[row]} reaches position {seq_lens[row] - 1}, "
                               f"past the {held[row] // block_size} blocks of {block_size} it holds")
        token_rows = np.repeat(np.arange(count), query_lens)
        slot_mapping = tables[token_rows, positions // block_size] * block_size + positions % block_size
        last_rows = query_start_loc[1:] - 1
        logits = last_rows if data.sampled_rows is None else last_rows[np.array(data.sampled_rows, np.int64)]
        if data.extra_rows:
            logits = np.concatenate([logits] + [np.arange(r, r + n) for r, n in data.extra_rows])
        self.input_ids = np.array(data.token_ids, np.int64)
        self.positions = np.ascontiguousarray(positions, dtype=np.int64)
        self.slot_mapping, self.query_start_loc, self.seq_lens = slot_mapping, query_start_loc, seq_lens
        self.block_tables, self.max_seq_len, self.num_hidden_rows = tables, longest, data.num_hidden_rows
        self.logits_indices = np.ascontiguousarray(logits, dtype=np.int64)
        self._plain_decode = data.is_plain_decode

    def _advance(self, data: StepData) -> bool:
        """A plain decode step of the last plain decode step's rows: each row's token, position, length and
        slot written over the last arrays (the tables too, where rows gained blocks), four numpy calls
        whatever the rows (numpy's per-call cost is most of a few rows' time). False: the tables grew wider,
        so they are a new array."""
        computed = data.num_computed_tokens
        if len(computed) != len(self._blocks):
            raise RuntimeError(f"step data repeats the last step's {len(self._blocks)} rows with "
                               f"{len(computed)} rows' positions")
        self._grow(data.new_block_ids)
        longest = max(computed) + 1
        block_size = self.block_size
        width = -(-longest // block_size)
        same = width == self.block_tables.shape[1]
        if not same:
            self.block_tables = self._tables(width)
        elif data.new_block_ids:
            for seq_id, _ in data.new_block_ids:
                row, blocks = self.seq_ids.index(seq_id), self._blocks_of[seq_id]
                self.block_tables[row, :min(width, len(blocks))] = blocks[:width]
        self.input_ids[:] = data.token_ids
        self.positions[:] = computed
        self.seq_lens[:] = [position + 1 for position in computed]
        self.slot_mapping[:] = [blocks[position // block_size] * block_size + position % block_size
                                for blocks, position in zip(self._blocks, computed)]
        self.max_seq_len = longest
        return same

    def multimodal_rows(self) -> dict[int, object]:
        """Row -> media inputs of the rows whose requests carry them (``ForwardBatch.multimodal``)."""
        if not self._multimodal_of:
            return {}
        return {row: self._multimodal_of[seq_id] for row, seq_id in enumerate(self.seq_ids)
                if seq_id in self._multimodal_of}

    def to_batch(self, device: torch.device) -> ForwardBatch:
        """The arrays as a ``ForwardBatch`` on ``device`` (on the CPU, over the arrays' own memory)."""
        if torch.device(device).type == "cpu":
            # the arrays' own memory: no copy (a decode step's fixed cost)
            tensor = torch.from_numpy
        else:
            def tensor(array: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(array).to(device, non_blocking=True)

        rows = self.seq_lens.shape[0]
        if self.input_ids.shape[0] == rows:  # every row computes >= 1 token, so one each: a decode step
            query_lens, max_query_len = [1] * rows, 1 if rows else 0
        else:
            lens = np.diff(self.query_start_loc)
            query_lens, max_query_len = lens.tolist(), int(lens.max()) if lens.size else 0
        return ForwardBatch(
            input_ids=tensor(self.input_ids), positions=tensor(self.positions),
            slot_mapping=tensor(self.slot_mapping), query_start_loc=tensor(self.query_start_loc),
            seq_lens=tensor(self.seq_lens), block_tables=tensor(self.block_tables),
            logits_indices=tensor(self.logits_indices), query_lens=query_lens, max_query_len=max_query_len,
            max_seq_len=self.max_seq_len, block_size=self.block_size, multimodal=self.multimodal_rows())
