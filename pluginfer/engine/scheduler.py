"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step has a token budget and a cap on sequences. Running decodes go first (one
token each, oldest first); when a block cannot be had, the newest running sequence is
preempted by recompute. Then running prefills cut short by chunking continue, then
waiting sequences are admitted in arrival order until blocks or budget run out.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from pluginfer.core.config import SchedulerConfig
from pluginfer.core.speculative import DraftRequest, Proposer
from pluginfer.engine.kv_cache import BlockManager
from pluginfer.engine.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSequence:
    """One row of a step: the next num_new_tokens of seq, from seq.num_computed_tokens on."""

    seq: Sequence
    num_new_tokens: int
    # Sequences that get a token sampled from this row's logits: [] for a chunk that does
    # not reach the end; [parent, child, ...] when an n > 1 request finishes its prompt.
    sample_for: list[Sequence]
    # A decode's speculative tokens, computed after its last token (num_new_tokens = 1 + len), and how many
    # of them the model agreed with (set by the engine once it has sampled).
    draft_token_ids: list[int] = field(default_factory=list)
    num_accepted: int = 0


@dataclass
class SchedulerOutput:
    """What one step runs, and what the scheduler changed on the way."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)  # decodes first, then prefills
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # finished with FinishReason.ERROR
    step_id: int = 0  # this output's number, counted by schedule()
    # The step_id of the last output when these are its rows again, each decoding one more token within the
    # blocks it held (nothing added, removed or moved): the workers then only need each row's token and position.
    repeats: int | None = None

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(row.num_new_tokens for row in self.scheduled)


@dataclass
class _Step:
    """Bookkeeping while one step is being scheduled."""

    budget: int
    max_seqs: int
    output: SchedulerOutput
    prefills: list[ScheduledSequence] = field(default_factory=list)
    scheduled_ids: set[int] = field(default_factory=set)
    reserved_blocks: int = 0  # kept free for this step's forks

    def is_full(self) -> bool:
        return self.budget <= 0 or len(self.scheduled_ids) >= self.max_seqs

    def add(self, row: ScheduledSequence, is_decode: bool) -> None:
        (self.output.scheduled if is_decode else self.prefills).append(row)
        self.scheduled_ids.add(row.seq.seq_id)
        self.budget -= row.num_new_tokens


class Scheduler:
    """Decides each step's batch; owns the waiting queue and the running list."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 proposer: Proposer | None = None, num_speculative_tokens: int = 0, vocab_size: int = 0,
                 max_loras: int = 0) -> None:
        self.config = config
        self.max_loras = max_loras  # distinct LoRA adapters running at once (0: no adapters)
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()  # may hold aborted sequences, skipped when reached
        self.running: list[Sequence] = []  # in order of admission; the last one is preempted first
        self._num_waiting = 0
        self._children: dict[int, list[Sequence]] = {}  # parent seq_id -> seqs forked at its prompt's end
        self._requests: dict[str, list[Sequence]] = {}
        self._rejected: list[Sequence] = []
        self._finished: list[Sequence] = []
        self._block_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0  # since start, for metrics and tests
        # The last step's rows when every running sequence ran a decode; None once the running set changed.
        self._decodes: list[ScheduledSequence] | None = None
        self._step_id = 0
        self.proposer, self.num_speculative_tokens, self.vocab_size = proposer, num_speculative_tokens, vocab_size
        self.num_drafts = self.num_draft_tokens = 0  # since start: decodes given drafts, and their draft tokens

    # -- requests --------------------------------------------------------------------------

    def add_request(self, seqs: list[Sequence]) -> None:
        """Queue one request's n sequences; only the first is prefilled, the rest fork from it."""
        if not seqs:
            return
        parent = seqs[0]
        if parent.request_id in self._requests:
            raise ValueError(f"request id {parent.request_id!r} is already in the scheduler")
        error = self._admission_error(parent)
        if error:
            for seq in seqs:
                seq.finish(FinishReason.ERROR, error)
            self._rejected.extend(seqs)
            return
        self._requests[parent.request_id] = list(seqs)
        if len(seqs) > 1:
            self._children[parent.seq_id] = list(seqs[1:])
        self.waiting.append(parent)
        self._num_waiting += 1

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> list[Sequence]:
        """Finish all the request's sequences (ABORT, or FAILED when its step raised) and free their blocks now."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return []
        pending = self._children.pop(seqs[0].seq_id, [])
        aborted = [seq for seq in seqs if not seq.is_finished]
        for seq in aborted:
            if seq.status is SequenceStatus.WAITING and not any(seq is child for child in pending):
                self._num_waiting -= 1  # stays in the deque until it reaches the front
            self.block_manager.free(seq)
            seq.finish(reason, error)
        ids = {seq.seq_id for seq in aborted}
        if self.proposer is not None and ids:
            self.proposer.forget(list(ids))
        self.running = [seq for seq in self.running if seq.seq_id not in ids]
        self._decodes = None
        self._finished.extend(aborted)
        return aborted

    def has_unfinished(self) -> bool:
        """True while some sequence still waits, runs, or has a rejection to report."""
        return bool(self.running or self._num_waiting or self._rejected)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's rows: decodes, then running chunked prefills, then new prefills."""
        self._step_id += 1
        steady = self._steady_decodes()
        if steady is not None:
            return steady
        output = SchedulerOutput(block_copies=self._block_copies, rejected=self._rejected, step_id=self._step_id)
        self._block_copies, self._rejected = [], []
        self._finished.extend(output.rejected)
        step = _Step(self.config.max_num_batched_tokens, self.config.max_num_seqs, output)
        unfinished_prefills = self._schedule_decodes(step)
        if self.proposer is not None and output.scheduled:
            self._draft(step)
        self._schedule_running_prefills(step, unfinished_prefills)
        if not output.preempted:  # admitting now would only take back what was just freed
            self._admit_waiting(step)
        output.scheduled.extend(step.prefills)
        if not output.scheduled:
            # no forward runs this step: keep the copies for the next one
            self._block_copies, output.block_copies = output.block_copies, []
        every_decode = output.scheduled and not step.prefills and len(output.scheduled) == len(self.running)
        steady = every_decode and not output.preempted and self.proposer is None  # drafts change every step
        self._decodes = output.scheduled if steady else None
        return output

    def _steady_decodes(self) -> SchedulerOutput | None:
        """The last step's rows again, when it ran every running sequence as a decode and nothing changed
        since but one more token each: nothing waits, was rejected or awaits a block copy, no running
        sequence was added or removed (``_decodes`` is dropped when one is), and each still fits the context
        and its blocks (no block to take, so nobody to preempt). What the phases would schedule then, without
        them (the steady state of generation); None: schedule by the phases."""
        rows = self._decodes
        if rows is None or self.waiting or self._rejected or self._block_copies:
            return None
        manager = self.block_manager
        block_size, max_len = manager.block_size, min(self.max_model_len, manager.num_blocks * manager.block_size)
        for row in rows:
            seq = row.seq
            length = len(seq)
            if length - seq.num_computed_tokens != 1 or length > max_len or length > len(seq.block_table) * block_size:
                return None
        return SchedulerOutput(scheduled=rows, step_id=self._step_id, repeats=self._step_id - 1)

    def update(self, output: SchedulerOutput) -> list[Sequence]:
        """Account for a finished forward; return the sequences finished since the last call."""
        for row in output.scheduled:
            seq = row.seq
            if seq.finish_reason in (FinishReason.ABORT, FinishReason.FAILED):
                continue  # abort() already freed it
            # a draft the model disagreed with leaves its KV in slots the next tokens write over
            seq.num_computed_tokens += row.num_new_tokens - len(row.draft_token_ids) + row.num_accepted
            self.block_manager.commit_full_blocks(seq)
            if len(row.sample_for) > 1:
                self._fork_children(seq, row.sample_for[1:])
        done = [seq for seq in self.running if seq.is_finished]
        if done:
            self._decodes = None
            self.running = [seq for seq in self.running if not seq.is_finished]
            for seq in done:
                self._retire(seq)
        finished, self._finished = self._finished, []
        return finished

    # -- the three phases ------------------------------------------------------------------

    def _schedule_decodes(self, step: _Step) -> list[Sequence]:
        """Schedule one token for each running decode; return the running unfinished prefills."""
        unfinished_prefills = []
        index = 0
        while index < len(self.running) and not step.is_full():
            seq = self.running[index]
            if seq.num_uncomputed_tokens < 1:
                raise RuntimeError(f"sequence {seq.seq_id} has no token to compute: the engine must "
                                   "append a sampled token to every sequence in sample_for")
            # the children fork at the prompt's end; an embedding's last token is a prefill chunk, never a decode
            if seq.is_prefill or seq.seq_id in self._children or seq.pooling is not None:
                unfinished_prefills.append(seq)
            elif self._context_is_full(seq):
                self.running.pop(index)
                seq.finish(FinishReason.LENGTH)
                self._retire(seq)
                continue
            elif self._make_room(seq, 1, step, may_preempt_self=True):
                self.block_manager.ensure_slots(seq, 1)
                step.add(ScheduledSequence(seq, 1, [seq]), is_decode=True)
            else:
                break  # seq itself was the newest and has been preempted
            index += 1
        return unfinished_prefills

    def _draft(self, step: _Step) -> None:
        """Ask the proposer for draft tokens of this step's decodes, each cut to what its output, the context,
        the step's budget and the free blocks leave room for (speculation never preempts)."""
        manager, rows, requests = self.block_manager, [], []
        for row in step.output.scheduled:
            seq = row.seq
            left = seq.params.max_tokens
            room = min(self.num_speculative_tokens, self.max_model_len - len(seq),
                       self.num_speculative_tokens if left is None else left - len(seq.output_token_ids) - 1)
            if room > 0:
                rows.append(row)
                requests.append(DraftRequest(seq.seq_id, seq.token_ids, room))
        if not requests:
            return
        name = type(self.proposer).__name__
        try:
            # drafts only save model passes: a proposer that fails costs its speedup, never a request
            proposals = self.proposer.propose(requests)
            if len(proposals) != len(requests):
                raise ValueError(f"{len(proposals)} drafts for {len(requests)} sequences")
        except Exception as exc:
            logger.error("speculative proposer %s failed, this step decodes without drafts: %s: %s",
                         name, type(exc).__name__, exc)
            return
        for row, request, draft in zip(rows, requests, proposals):
            try:
                draft = [int(token) for token in draft[:min(request.max_tokens, step.budget)]]
            except (TypeError, ValueError):
                draft = [-1]
            if any(not 0 <= token < self.vocab_size for token in draft):
                logger.error("speculative proposer %s drafted something other than token ids below the "
                             "vocabulary size %d; dropped", name, self.vocab_size)
                continue
            free = manager.num_free_blocks - step.reserved_blocks
            while draft and manager.num_blocks_needed(row.seq, 1 + len(draft)) > free:
                draft.pop()
            if draft:
                manager.ensure_slots(row.seq, 1 + len(draft))
                row.num_new_tokens += len(draft)
                row.draft_token_ids = draft
                step.budget -= len(draft)
                self.num_drafts += 1
                self.num_draft_tokens += len(draft)

    def _schedule_running_prefills(self, step: _Step, seqs: list[Sequence]) -> None:
        """Continue prefills that chunking cut short, oldest first."""
        for seq in seqs:
            if step.is_full():
                return
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this phase
            chunk = self._chunk_size(seq, step.budget)
            if chunk and not self._make_room(seq, chunk, step, may_preempt_self=False):
                # Newer sequences hold the blocks but already run this step: take what is left.
                free = max(0, self.block_manager.num_free_blocks - step.reserved_blocks)
                held = len(seq.block_table) * self.block_manager.block_size - seq.num_computed_tokens
                chunk = min(chunk, held + free * self.block_manager.block_size)
            if chunk:
                self._schedule_prefill(seq, chunk, step)

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting sequences in order while blocks, budget and sequence slots last."""
        manager = self.block_manager
        while self.waiting and not step.is_full():
            seq = self.waiting[0]
            if seq.is_finished or self._context_is_full(seq):
                self.waiting.popleft()
                if not seq.is_finished:  # preempted, or a forked child, that outgrew the cache
                    self._num_waiting -= 1
                    seq.finish(FinishReason.LENGTH)
                    self._retire(seq)
                continue  # (a finished one was aborted while waiting)
            group = 1 + len(self._children.get(seq.seq_id, ()))
            if self.running and len(self.running) + group > self.config.max_num_seqs:
                return
            if seq.lora is not None and not self._adapter_fits(seq):
                return  # every LoRA slot is taken by running sequences' adapters
            manager.allocate_prompt(seq)
            chunk = self._chunk_size(seq, step.budget)
            needed = manager.num_blocks_needed(seq, chunk)
            if chunk == 0 or needed > manager.num_free_blocks - step.reserved_blocks:
                manager.free(seq)  # give back the cached prefix it was lent
                seq.num_computed_tokens = seq.num_cached_prompt_tokens = 0
                return
            self.waiting.popleft()
            self._num_waiting -= 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule_prefill(seq, chunk, step)

    # -- helpers ---------------------------------------------------------------------------

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter is running already or a LoRA slot is left for it."""
        running = {other.lora.key for other in self.running if other.lora is not None}
        return seq.lora.key in running or len(running) < self.max_loras

    def _schedule_prefill(self, seq: Sequence, chunk: int, step: _Step) -> None:
        """Take blocks for a prefill chunk and add its row; the last chunk samples."""
        manager = self.block_manager
        if not manager.ensure_slots(seq, chunk):
            raise RuntimeError("scheduler bug: blocks were checked but are missing")
        sample_for: list[Sequence] = []
        if seq.num_computed_tokens + chunk == len(seq) and seq.pooling is None:  # an embedding samples nothing
            children = self._children.get(seq.seq_id, [])
            sample_for = [seq, *children]
            if children and len(seq) % manager.block_size:
                # Each child copies the partial last block at update(); keep blocks for that.
                spare = manager.num_free_blocks - step.reserved_blocks
                step.reserved_blocks += max(0, min(len(children), spare))
        step.add(ScheduledSequence(seq, chunk, sample_for), is_decode=False)

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq's remaining prefill to compute this step (0: wait)."""
        remaining = seq.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        if seq.pooling is not None and seq.pooling.whole_prompt:
            # an encoder's prompt is read whole: wait for a step with room for it
            return 0
        # A prefill longer than a whole step's budget is chunked even when chunking is off.
        if self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens:
            return budget
        return 0

    def _make_room(self, seq: Sequence, num_tokens: int, step: _Step, may_preempt_self: bool) -> bool:
        """Preempt the newest running sequences until seq's tokens fit; False if they do not."""
        manager = self.block_manager
        while manager.num_blocks_needed(seq, num_tokens) > manager.num_free_blocks - step.reserved_blocks:
            victim = self.running[-1]
            if victim.seq_id in step.scheduled_ids or (victim is seq and not may_preempt_self):
                return False
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        """Preempt the newest running sequence by recompute: back to the front of the queue."""
        assert self.running[-1] is seq
        self.running.pop()
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        if self.proposer is not None:
            self.proposer.forget([seq.seq_id])
        self.waiting.appendleft(seq)
        self._num_waiting += 1
        step.output.preempted.append(seq)
        self.num_preemptions += 1

    def _fork_children(self, parent: Sequence, children: list[Sequence]) -> None:
        """After the parent's prompt is computed, give each child a share of its blocks."""
        self._decodes = None
        self._children.pop(parent.seq_id, None)
        for child in children:
            if child.is_finished:
                if child.finish_reason not in (FinishReason.ABORT, FinishReason.FAILED):
                    self._retire(child)
            elif self.block_manager.can_fork(parent):
                self._block_copies.extend(self.block_manager.fork(parent, child))
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            else:
                # no block for the copy: the child recomputes its prompt and first token
                child.reset_for_recompute()
                self.waiting.appendleft(child)
                self._num_waiting += 1

    def _retire(self, seq: Sequence) -> None:
        """Free a finished sequence and report it at the next update()."""
        self.block_manager.free(seq)
        if self.proposer is not None:
            self.proposer.forget([seq.seq_id])
        self._finished.append(seq)
        seqs = self._requests.get(seq.request_id)
        if seqs is not None and all(other.is_finished for other in seqs):
            del self._requests[seq.request_id]

    def _context_is_full(self, seq: Sequence) -> bool:
        """True if seq's tokens exceed the model's context or the whole cache."""
        manager = self.block_manager
        return len(seq) > self.max_model_len or manager.blocks_for(len(seq)) > manager.num_blocks

    def _admission_error(self, seq: Sequence) -> str | None:
        """Why a request can never run, or None."""
        length, manager = len(seq), self.block_manager
        if length == 0:
            return "the prompt is empty"
        if length > self.max_model_len:
            return f"the prompt has {length} tokens, more than the model's context of {self.max_model_len} tokens"
        if manager.blocks_for(length) > manager.num_blocks:
            return (f"the prompt has {length} tokens, more than the KV cache holds "
                    f"({manager.num_blocks} blocks of {manager.block_size} tokens)")
        return None
