"""StepInput: one engine step as plain host integers, what the driver sends every rank.

The driver flattens the scheduled sequences (``build_step``); each worker turns the result into a
``ForwardBatch`` on its own device (``StepInput.to_batch``) and lets its backend build the
attention metadata. No ``Sequence`` object and no device tensor crosses ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pluginfer.core.batch import ForwardBatch

if TYPE_CHECKING:
    from pluginfer.engine.scheduler import ScheduledSequence
    from pluginfer.engine.sequence import Sequence


@dataclass
class StepInput:
    """Flat int64 arrays of one step (see ``ForwardBatch`` for their meaning) and the block copies."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    logits_indices: np.ndarray
    block_size: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The last ``num_hidden_rows`` rows of ``logits_indices`` are pooled (embeddings): their final hidden
    # states come back instead of logits.
    num_hidden_rows: int = 0
    max_seq_len: int | None = None  # ``seq_lens.max()`` when the builder knew it (None: computed from the array)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_logits(self) -> int:
        return int(self.logits_indices.shape[0])

    def to_batch(self, device: torch.device) -> ForwardBatch:
        if torch.device(device).type == "cpu":  # the arrays' own memory: no copy (a decode step's fixed cost)
            tensor = torch.from_numpy
        else:
            def tensor(array: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(array).to(device, non_blocking=True)

        seqs = self.seq_lens.shape[0]
        if self.input_ids.shape[0] == seqs:  # every row computes >= 1 token, so one each: a decode step
            query_lens, max_query_len = [1] * seqs, 1 if seqs else 0
        else:
            lens = np.diff(self.query_start_loc)
            query_lens, max_query_len = lens.tolist(), int(lens.max()) if lens.size else 0
        return ForwardBatch(
            input_ids=tensor(self.input_ids),
            positions=tensor(self.positions),
            slot_mapping=tensor(self.slot_mapping),
            query_start_loc=tensor(self.query_start_loc),
            seq_lens=tensor(self.seq_lens),
            block_tables=tensor(self.block_tables),
            logits_indices=tensor(self.logits_indices),
            query_lens=query_lens,
            max_query_len=max_query_len,
            max_seq_len=self.max_seq_len if self.max_seq_len is not None else
            int(self.seq_lens.max()) if seqs else 0,
            block_size=self.block_size,
        )


@dataclass
class StepResult:
    """What a step returns to the driver: float32 logits ``[num_logits - num_hidden_rows, vocab]`` and the
    pooled rows' final hidden states ``[num_hidden_rows, hidden]`` (float32)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass
class StepPlan:
    """The driver's side of a step: the StepInput and what its logits rows mean."""

    step: StepInput
    prompt_logprob_rows: list[tuple[Sequence, int, int]]  # (sequence, first position, logits rows)
    pooling_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, first position, rows)


def build_step(scheduled: list[ScheduledSequence], block_size: int,
               block_copies: list[tuple[int, int]] | None = None) -> StepPlan:
    """Flatten the step: tokens, positions, cache slots and block tables of every sequence."""
    plain = _plain_decode_step(scheduled, block_size, block_copies)
    return plain if plain is not None else _flatten(scheduled, block_size, block_copies)


class StepBuilder:
    """:func:`build_step` for one driver, which updates the last step's arrays in place when the scheduler
    hands over the same rows again (``Scheduler`` does so while the running sequences only decode and take no
    block): each row's token, position, length and slot are written over, and the same ``StepPlan`` (the same
    ``StepInput`` object) comes back. The arrays equal what :func:`build_step` would make; any other step is
    built afresh. A step's arrays are read before the next one is built (the worker, the broadcast to the
    other ranks); nothing may keep them past their step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._rows: list[ScheduledSequence] | None = None  # the rows of the last plain decode step, as given
        self._plan: StepPlan | None = None
        self._table_lengths: list[int] = []

    def build(self, scheduled: list[ScheduledSequence], block_copies: list[tuple[int, int]] | None = None) -> StepPlan:
        if scheduled is self._rows and not block_copies and self._advance(scheduled):
            return self._plan
        plan = _plain_decode_step(scheduled, self.block_size, block_copies)
        if plan is None:
            self._rows = None
            return _flatten(scheduled, self.block_size, block_copies)
        self._rows, self._plan = (None, None) if block_copies else (scheduled, plan)
        self._table_lengths = [len(item.seq.block_table) for item in scheduled]
        return plan

    def _advance(self, scheduled: list[ScheduledSequence]) -> bool:
        """Write this step's values of the same decode rows into the last step's arrays; False: the block
        tables' width or a table changed (then the arrays, part-written, are dropped)."""
        step, block_size = self._plan.step, self.block_size
        width, lengths = step.block_tables.shape[1], self._table_lengths
        ids, positions, slots, seq_lens = step.input_ids, step.positions, step.slot_mapping, step.seq_lens
        longest = 0
        for row, item in enumerate(scheduled):
            seq = item.seq
            position, table = seq.num_computed_tokens, seq.block_table
            block = position // block_size
            if block >= width or len(table) != lengths[row]:
                self._rows = None
                return False
            ids[row] = seq.last_token_id
            positions[row] = position
            seq_lens[row] = position + 1
            slots[row] = table[block] * block_size + position % block_size
            if position > longest:
                longest = position
        if longest // block_size + 1 != width:  # build_step's tables are as wide as the longest row needs
            self._rows = None
            return False
        step.max_seq_len = longest + 1
        return True


def _flatten(scheduled: list[ScheduledSequence], block_size: int,
             block_copies: list[tuple[int, int]] | None) -> StepPlan:
    """:func:`build_step` of any step, prefill chunks, prompt logprobs and pooled rows included."""
    count = len(scheduled)
    starts = np.fromiter((s.seq.num_computed_tokens for s in scheduled), np.int64, count)
    query_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, count)
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(count + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    if int(query_lens.max()) == 1:  # decode-only: one token per sequence, no concatenation
        input_ids = np.fromiter((s.seq.last_token_id for s in scheduled), np.int64, count)
        positions = starts
    else:
        input_ids = np.concatenate([
            np.asarray(s.seq.token_slice(int(a), int(a + n)), np.int64)
            for s, a, n in zip(scheduled, starts, query_lens)])
        positions = np.repeat(starts - query_start_loc[:-1], query_lens) + np.arange(query_start_loc[-1])
    max_blocks = int(-(-seq_lens.max() // block_size))
    tables = np.zeros((count, max_blocks), np.int64)
    for row, s in enumerate(scheduled):
        table = s.seq.block_table[:max_blocks]
        tables[row, : len(table)] = table
    token_rows = np.repeat(np.arange(count), query_lens)
    slot_mapping = tables[token_rows, positions // block_size] * block_size + positions % block_size
    sampling = [row for row, s in enumerate(scheduled) if s.sample_for]
    logits_rows = query_start_loc[1:][sampling] - 1
    prompt_rows = _prompt_logprob_rows(scheduled, starts, query_lens, query_start_loc)
    pooling_rows = _pooling_rows(scheduled, starts, query_lens, query_start_loc)
    extra = [(r, n) for _, _, r, n in prompt_rows] + [(r, n) for _, _, r, n in pooling_rows]
    if extra:
        logits_rows = np.concatenate([logits_rows] + [np.arange(r, r + n) for r, n in extra])
    step = StepInput(input_ids=input_ids, positions=np.ascontiguousarray(positions), slot_mapping=slot_mapping,
                     query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=tables,
                     logits_indices=np.ascontiguousarray(logits_rows, dtype=np.int64), block_size=block_size,
                     block_copies=list(block_copies or []), num_hidden_rows=sum(n for _, _, _, n in pooling_rows))
    return StepPlan(step, [(seq, first, n) for seq, first, _, n in prompt_rows],
                    [(seq, first, n) for seq, first, _, n in pooling_rows])


def _plain_decode_step(scheduled: list[ScheduledSequence], block_size: int,
                       block_copies: list[tuple[int, int]] | None) -> StepPlan | None:
    """:func:`build_step` of a step in which every row computes one token and samples, and none asks for prompt
    logprobs or pooling (the steady state of generation), in plain Python: numpy's per-call cost is most of
    the general path's time at a few rows (~30 us a step). The same arrays; None: not such a step."""
    ids, positions, tables = [], [], []
    for item in scheduled:
        seq = item.seq
        if item.num_new_tokens != 1 or not item.sample_for or seq.pooling is not None \
                or seq.params.prompt_logprobs is not None:
            return None
        ids.append(seq.last_token_id)
        positions.append(seq.num_computed_tokens)
        tables.append(seq.block_table)
    if not ids:
        return None
    count = len(ids)
    longest = max(positions)
    max_blocks = longest // block_size + 1  # ceil((position + 1) / block_size)
    block_tables = np.zeros((count, max_blocks), np.int64)
    slots = []
    for row, (table, position) in enumerate(zip(tables, positions)):
        table = table[:max_blocks]
        block_tables[row, :len(table)] = table
        slots.append(table[position // block_size] * block_size + position % block_size)
    rows = np.arange(count, dtype=np.int64)
    position_array = np.array(positions, np.int64)
    step = StepInput(input_ids=np.array(ids, np.int64), positions=position_array,
                     slot_mapping=np.array(slots, np.int64), query_start_loc=np.arange(count + 1, dtype=np.int64),
                     seq_lens=position_array + 1, block_tables=block_tables, logits_indices=rows,
                     block_size=block_size, block_copies=list(block_copies or []), max_seq_len=longest + 1)
    return StepPlan(step, [], [])


def _pooling_rows(scheduled: list[ScheduledSequence], starts: np.ndarray, query_lens: np.ndarray,
                  query_start_loc: np.ndarray) -> list[tuple]:
    """(seq, first position, flat row, count) of the hidden states each embedding's chunk must return."""
    rows = []
    for index, item in enumerate(scheduled):
        pooling = item.seq.pooling
        if pooling is None:
            continue
        first, count = int(starts[index]), int(query_lens[index])
        offset, wanted = pooling.rows(first, count, item.seq.num_prompt_tokens)
        rows.append((item.seq, first, int(query_start_loc[index]) + offset, wanted))
    return rows


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
