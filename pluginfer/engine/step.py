"""StepData: one engine step as the workers read it, and the driver's ``StepDataBuilder`` that makes it.

The scheduler's rows hold ``Sequence`` objects; no ``Sequence`` and no device tensor crosses ranks. Each
worker keeps the batch's rows and block tables (``InputBatch``) between steps, so a step says only which rows
are new (with their whole block tables), which rows left (finished, preempted, or not scheduled this step),
which blocks the held rows gained, and what every row computes now (its tokens and first position). When
the rows are the last step's, in the same order, the step says so (``same_rows``): the worker then writes
the new values over its last arrays instead of building them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pluginfer.engine.lora import LoRASlotTable
    from pluginfer.engine.scheduler import ScheduledSequence, SchedulerOutput
    from pluginfer.engine.sequence import Sequence


@dataclass
class NewRow:
    """A sequence that enters the batch this step: its id and its whole block table."""

    seq_id: int
    block_ids: list[int]
    # the request's media inputs for the model (Sequence.multimodal)
    multimodal: object | None = None
    lora_slot: int = -1  # the LoRA slot of its adapter (-1: the base model)


@dataclass
class StepData:
    """One step, host integers only (the message the driver broadcasts to every rank).

    Per row, in batch order: ``num_computed_tokens`` (the position of its first token this step) and
    ``num_new_tokens`` (None: one each, a decode step); ``token_ids`` holds the tokens every row computes,
    row after row. The rows' identities and block tables are deltas against the workers' last step."""

    token_ids: list[int]
    num_computed_tokens: list[int]
    block_size: int
    num_new_tokens: list[int] | None = None
    # the rows in order (may be empty with same_rows: the last step's)
    seq_ids: list[int] = field(default_factory=list)
    new_rows: list[NewRow] = field(default_factory=list)  # rows the workers do not hold
    new_block_ids: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq id, blocks appended) of held rows
    removed_ids: list[int] = field(default_factory=list)  # held rows that leave the batch
    # the last step's rows in the same order: none added, removed or moved
    same_rows: bool = False
    # the workers drop every row they hold first (the driver lost track of them)
    reset: bool = False
    # rows whose last token's logits are sampled; None: every row
    sampled_rows: list[int] | None = None
    # (flat token row, count) of extra rows whose outputs come back after the sampled ones: prompt logprobs,
    # then speculative decoding's checks of draft tokens, then the pooled rows (embeddings), the last ``num_hidden_rows`` of them, whose final hidden states come
    # back instead of logits.
    extra_rows: list[tuple[int, int]] = field(default_factory=list)
    num_hidden_rows: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks, before the forward
    lora_loads: list[tuple[int, str, str, int]] = field(default_factory=list)  # (slot, path, name, id), before it

    @property
    def num_rows(self) -> int:
        return len(self.num_computed_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_plain_decode(self) -> bool:
        """Every row computes one token and samples it; nothing else comes back (the steady state of generation)."""
        return self.num_new_tokens is None and self.sampled_rows is None and not self.extra_rows


@dataclass
class StepResult:
    """What a step returns to the driver: float32 logits ``[sampled + prompt logprob rows, vocab]`` and the
    pooled rows' final hidden states ``[num_hidden_rows, hidden]`` (float32)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass
class StepPlan:
    """The driver's side of a step: the StepData and what its logits rows mean."""

    data: StepData
    # the logits row each sampling sequence samples from (n > 1: children share one)
    sample_rows: list[int]
    sample_seqs: list[Sequence]
    # logits rows that are sampled; the prompt logprob rows follow them
    num_sampled_rows: int
    prompt_logprob_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, first position, rows)
    pooling_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, first position, rows)
    draft_rows: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, its draft tokens' logits rows)
    # the last step's rows again: the same sequences sample, in the same order
    repeated: bool = False


class StepDataBuilder:
    """The driver's record of what the workers hold (each row's seq id and how many of its blocks), turned
    into each step's ``StepData``. A step must reach every worker once it is built; when one may not have
    (the step raised), ``forget`` makes the next step start the workers' batch over."""

    def __init__(self, block_size: int, lora_slots: LoRASlotTable | None = None) -> None:
        self.block_size = block_size
        # which adapter each LoRA slot of the workers holds (None: no LoRA)
        self.lora_slots = lora_slots
        self._held: dict[int, int] = {}  # seq id -> blocks of its table the workers hold
        self._order: list[int] = []  # the last step's rows, by seq id
        self._last_step_id: int | None = None  # the scheduler's id of the last step built
        self._last_plan: StepPlan | None = None
        self._reset = False

    def forget(self) -> None:
        """The workers' batch is unknown: the next step sends every row anew and resets it."""
        self._held, self._order, self._last_step_id, self._last_plan, self._reset = {}, [], None, None, True
        if self.lora_slots is not None:
            self.lora_slots.forget()  # the workers may not have loaded what the last step sent

    def build(self, output: SchedulerOutput) -> StepPlan:
        """This step's data: a repeat of the last step's rows (``output.repeats`` names the step built last)
        only refreshes each row's token and position; any other step is compared row by row."""
        if output.repeats is not None and output.repeats == self._last_step_id and self._last_plan is not None:
            plan = self._repeat(output.scheduled, self._last_plan)
        else:
            plan = self._compare(output)
        self._last_step_id, self._last_plan = output.step_id, plan
        return plan

    def _repeat(self, scheduled: list[ScheduledSequence], last: StepPlan) -> StepPlan:
        """The last step's decode rows again, each one token further, within the blocks the workers hold."""
        data = StepData(token_ids=[row.seq.last_token_id for row in scheduled],
                        num_computed_tokens=[row.seq.num_computed_tokens for row in scheduled],
                        block_size=self.block_size, same_rows=True)
        return StepPlan(data, last.sample_rows, last.sample_seqs, last.num_sampled_rows, repeated=True)

    def _compare(self, output: SchedulerOutput) -> StepPlan:
        scheduled = output.scheduled
        seq_ids, starts, lens, new_rows, new_blocks, held = [], [], [], [], [], {}
        known, lora_loads = self._held, []
        in_use = {row.seq.lora.key for row in scheduled if row.seq.lora is not None}
        for row in scheduled:
            seq = row.seq
            seq_id, table = seq.seq_id, seq.block_table
            seq_ids.append(seq_id)
            starts.append(seq.num_computed_tokens)
            lens.append(row.num_new_tokens)
            count = known.get(seq_id)
            if count is None:
                slot = -1 if seq.lora is None else self.lora_slots.slot_for(seq.lora, in_use, lora_loads)
                new_rows.append(NewRow(seq_id, list(table), seq.multimodal, slot))
            elif len(table) > count:
                new_blocks.append((seq_id, table[count:]))
            held[seq_id] = len(table)
        removed = [seq_id for seq_id in known if seq_id not in held]
        decode = all(n == 1 for n in lens)
        if decode:
            token_ids = [row.seq.last_token_id for row in scheduled]
        else:  # a decode's drafts follow its last token
            token_ids = [token for row, start, n in zip(scheduled, starts, lens)
                         for token in row.seq.token_slice(start, start + n - len(row.draft_token_ids))
                         + row.draft_token_ids]
        sample_rows, sample_seqs, sampled = [], [], []
        for index, row in enumerate(scheduled):
            if row.sample_for:
                sample_rows.extend([len(sampled)] * len(row.sample_for))
                sample_seqs.extend(row.sample_for)
                sampled.append(index)
        row_starts = [0, *accumulate(lens)]
        prompt_rows = _prompt_logprob_rows(scheduled, starts, lens, row_starts)
        pooling_rows = _pooling_rows(scheduled, starts, lens, row_starts)
        # the logits of a decode's last token and its drafts but the last: each checks the draft after it
        draft_rows = [(row.seq, row_starts[index], len(row.draft_token_ids))
                      for index, row in enumerate(scheduled) if row.draft_token_ids]
        same_rows = not new_rows and not removed and not self._reset and seq_ids == self._order
        data = StepData(token_ids=token_ids, num_computed_tokens=starts, block_size=self.block_size,
                        num_new_tokens=None if decode else lens, seq_ids=seq_ids, new_rows=new_rows,
                        new_block_ids=new_blocks, removed_ids=removed, same_rows=same_rows, reset=self._reset,
                        sampled_rows=None if len(sampled) == len(scheduled) else sampled,
                        extra_rows=[(r, n) for _, _, r, n in prompt_rows] + [(r, n) for _, r, n in draft_rows]
                        + [(r, n) for _, _, r, n in pooling_rows],
                        num_hidden_rows=sum(n for _, _, _, n in pooling_rows), block_copies=list(output.block_copies),
                        lora_loads=lora_loads)
        self._held, self._order, self._reset = held, seq_ids, False
        return StepPlan(data, sample_rows, sample_seqs, len(sampled),
                        [(seq, first, n) for seq, first, _, n in prompt_rows],
                        [(seq, first, n) for seq, first, _, n in pooling_rows],
                        [(seq, n) for seq, _, n in draft_rows])


def _pooling_rows(scheduled: list[ScheduledSequence], starts: list[int], lens: list[int],
                  row_starts: list[int]) -> list[tuple]:
    """(seq, first position, flat row, count) of the hidden states each embedding's chunk must return."""
    rows = []
    for index, item in enumerate(scheduled):
        pooling = item.seq.pooling
        if pooling is None:
            continue
        first = starts[index]
        offset, wanted = pooling.rows(first, lens[index], item.seq.num_prompt_tokens)
        rows.append((item.seq, first, row_starts[index] + offset, wanted))
    return rows


def _prompt_logprob_rows(scheduled: list[ScheduledSequence], starts: list[int], lens: list[int],
                         row_starts: list[int]) -> list[tuple]:
    """(seq, first position, flat row, count) for prompt chunks whose logprobs were asked for.

    Row ``first + i`` predicts prompt token ``first + i + 1``; the prompt's last position
    predicts the first generated token and belongs to sampling.
    """
    rows = []
    for index, item in enumerate(scheduled):
        seq = item.seq
        if seq.params.prompt_logprobs is None or seq.index != 0:
            continue
        first = starts[index]
        count = min(first + lens[index], seq.num_prompt_tokens - 1) - first
        if count > 0 and len(seq.prompt_logprobs) <= first + 1:  # not again after a recompute
            rows.append((seq, first, row_starts[index], count))
    return rows
