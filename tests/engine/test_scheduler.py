"""Scheduler driven by hand: a fake forward appends a dummy token to each sampled sequence."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pluginfer.core.config import SchedulerConfig
from pluginfer.engine.kv_cache import BlockManager
from pluginfer.engine.scheduler import Scheduler, SchedulerOutput
from pluginfer.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

BLOCK = 4


def make_scheduler(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, chunked: bool = True,
                   prefix: bool = True, max_model_len: int = 1024) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked)
    return Scheduler(config, BlockManager(num_blocks, BLOCK, prefix), max_model_len)


def make_request(request_id: str, prompt: list[int] | range, max_tokens: int = 4, n: int = 1) -> list[Sequence]:
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return [Sequence(request_id, list(prompt), params, index=i) for i in range(n)]


def check_invariants(scheduler: Scheduler, output: SchedulerOutput, decoding: set[int]) -> None:
    """Budget, order, and block accounting right after schedule()."""
    manager, config = scheduler.block_manager, scheduler.config
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.scheduled) <= config.max_num_seqs
    kinds = [row.seq.seq_id in decoding for row in output.scheduled]
    assert kinds == sorted(kinds, reverse=True), "decodes come before prefills"
    for row in output.scheduled:
        assert row.num_new_tokens >= 1
        seq = row.seq
        assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + row.num_new_tokens
        assert seq.num_computed_tokens + row.num_new_tokens <= len(seq)
        reaches_end = seq.num_computed_tokens + row.num_new_tokens == len(seq)
        assert bool(row.sample_for) == reaches_end
    holders: Counter[int] = Counter()
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(set(seq.block_table)) == len(seq.block_table)
        holders.update(seq.block_table)
    for seq in scheduler.waiting:
        assert seq.block_table == [] or seq.is_finished
    for block in range(manager.num_blocks):
        assert manager.ref_count(block) == holders[block] >= 0
    assert manager.num_free_blocks == manager.num_blocks - len(holders)
    for seq in scheduler.running:  # a block in two tables is a full prefix/fork block in both
        for index, block in enumerate(seq.block_table):
            if holders[block] > 1:
                assert (index + 1) * BLOCK <= len(seq)


def step(scheduler: Scheduler, max_model_len: int = 1024) -> tuple[SchedulerOutput, list[Sequence]]:
    """schedule(), fake forward and sampling, the engine's stop checks, update()."""
    decoding = {seq.seq_id for seq in scheduler.running
                if seq.num_uncomputed_tokens == 1 and (seq.output_token_ids or seq.params.n == 1)}
    output = scheduler.schedule()
    check_invariants(scheduler, output, decoding)
    for row in output.scheduled:
        for seq in row.sample_for:
            seq.output_token_ids.append(1000 + len(seq))
            if len(seq.output_token_ids) >= seq.params.max_tokens or len(seq) >= max_model_len:
                seq.finish(FinishReason.LENGTH)
    return output, scheduler.update(output)


def run_until_done(scheduler: Scheduler, limit: int = 2000) -> list[Sequence]:
    finished: list[Sequence] = []
    for _ in range(limit):
        if not scheduler.has_unfinished():
            return finished
        finished += step(scheduler)[1]
    raise AssertionError("scheduler did not finish")


def test_token_budget_is_respected() -> None:
    scheduler = make_scheduler(budget=16)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", range(100 * i, 100 * i + 10)))
    output, _ = step(scheduler)
    assert [row.num_new_tokens for row in output.scheduled] == [10, 6]
    assert output.num_batched_tokens == 16
    output, _ = step(scheduler)
    assert output.num_batched_tokens == 16
    run_until_done(scheduler)


def test_decodes_come_before_prefills() -> None:
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(make_request("old", range(8), max_tokens=5))
    step(scheduler)
    scheduler.add_request(make_request("new", range(100, 140)))
    output, _ = step(scheduler)
    assert [row.seq.request_id for row in output.scheduled] == ["old", "new"]
    assert [row.num_new_tokens for row in output.scheduled] == [1, 15]


def test_chunked_prefill_splits_a_long_prompt_and_only_the_last_chunk_samples() -> None:
    scheduler = make_scheduler(budget=16)
    [seq] = make_request("long", range(40), max_tokens=2)
    scheduler.add_request([seq])
    chunks = []
    for _ in range(3):
        output, _ = step(scheduler)
        [row] = output.scheduled
        chunks.append((row.num_new_tokens, [s.seq_id for s in row.sample_for]))
    assert chunks == [(16, []), (16, []), (8, [seq.seq_id])]
    assert seq.num_computed_tokens == 40 and len(seq.output_token_ids) == 1


def test_without_chunking_a_prompt_waits_for_a_step_with_room() -> None:
    scheduler = make_scheduler(budget=16, chunked=False)
    scheduler.add_request(make_request("a", range(10)))
    scheduler.add_request(make_request("b", range(100, 110)))
    scheduler.add_request(make_request("huge", range(200, 240), max_tokens=1))
    output, _ = step(scheduler)
    assert [row.num_new_tokens for row in output.scheduled] == [10]  # b does not fit the 6 left
    finished = run_until_done(scheduler)
    huge = next(seq for seq in finished if seq.request_id == "huge")
    assert huge.finish_reason is FinishReason.LENGTH  # longer than any budget: chunked anyway


def test_tiny_cache_preempts_the_newest_which_later_completes() -> None:
    scheduler = make_scheduler(num_blocks=6, prefix=False)
    a, b = make_request("a", range(8), max_tokens=12), make_request("b", range(50, 58), max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted: list[Sequence] = []
    finished: list[Sequence] = []
    while scheduler.has_unfinished():
        output, done = step(scheduler)
        preempted += output.preempted
        finished += done
        for seq in output.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.block_table == []
            assert seq.num_computed_tokens == 0
    assert preempted and preempted[0] is b[0]
    assert {seq.request_id for seq in finished} == {"a", "b"}
    assert all(len(seq.output_token_ids) == 12 for seq in finished)
    assert scheduler.block_manager.num_free_blocks == 6


def test_over_long_prompts_are_rejected_while_others_continue() -> None:
    scheduler = make_scheduler(num_blocks=8, max_model_len=40)
    scheduler.add_request(make_request("ok", range(10), max_tokens=3))
    scheduler.add_request(too_long := make_request("too_long", range(41)))
    scheduler.add_request(too_big := make_request("too_big", range(36), n=2))  # cache holds 32
    output, finished = step(scheduler)
    assert output.rejected == too_long + too_big
    for seq in output.rejected:
        assert seq.finish_reason is FinishReason.ERROR
    assert "41" in too_long[0].error and "40" in too_long[0].error
    assert "36" in too_big[0].error and "8 blocks of 4" in too_big[0].error
    assert set(finished) == set(output.rejected)
    assert [row.seq.request_id for row in output.scheduled] == ["ok"]
    done = run_until_done(scheduler)
    assert [seq.request_id for seq in done] == ["ok"] and len(done[0].output_token_ids) == 3


def test_abort_frees_blocks_at_once() -> None:
    scheduler = make_scheduler(num_blocks=16)
    running, waiting = make_request("run", range(20), n=2), make_request("wait", range(30))
    scheduler.add_request(running)
    step(scheduler)
    scheduler.add_request(waiting)
    assert scheduler.block_manager.num_free_blocks < 16
    assert scheduler.abort("run") == running
    assert scheduler.abort("wait") == waiting
    assert scheduler.abort("unknown") == []
    assert scheduler.block_manager.num_free_blocks == 16
    assert all(seq.finish_reason is FinishReason.ABORT for seq in running + waiting)
    assert not scheduler.has_unfinished() and scheduler.num_waiting == 0
    output, finished = step(scheduler)
    assert output.scheduled == [] and finished == running + waiting


def test_abort_between_schedule_and_update() -> None:
    scheduler = make_scheduler()
    [seq] = make_request("r", range(9))
    scheduler.add_request([seq])
    output = scheduler.schedule()
    scheduler.abort("r")
    assert scheduler.update(output) == [seq]
    assert seq.num_computed_tokens == 0 and scheduler.block_manager.num_free_blocks == 64


def test_n_sequences_fork_from_the_prompt() -> None:
    scheduler = make_scheduler(num_blocks=16)
    parent, *children = seqs = make_request("n3", range(10), max_tokens=3, n=3)
    scheduler.add_request(seqs)
    output, _ = step(scheduler)
    [row] = output.scheduled
    assert row.seq is parent and row.num_new_tokens == 10 and row.sample_for == seqs
    manager = scheduler.block_manager
    full = parent.block_table[:2]
    for child in children:
        assert child.status is SequenceStatus.RUNNING and child.block_table[:2] == full
        assert child.num_computed_tokens == 10 and len(child.output_token_ids) == 1
    assert [manager.ref_count(block) for block in full] == [3, 3]
    partials = [seq.block_table[2] for seq in seqs]
    assert len(set(partials)) == 3
    output, _ = step(scheduler)  # the copies ride before the next forward
    assert output.block_copies == [(partials[0], partials[1]), (partials[0], partials[2])]
    assert [row.seq for row in output.scheduled] == seqs
    finished = run_until_done(scheduler)
    assert sorted(seq.index for seq in finished) == [0, 1, 2]
    assert all(len(seq.output_token_ids) == 3 for seq in seqs)
    assert manager.num_free_blocks == 16


def test_prefix_cache_hit_schedules_fewer_tokens() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("first", range(20)))
    step(scheduler)
    [second] = make_request("second", [*range(16), 77, 78, 79])
    scheduler.add_request([second])
    output, _ = step(scheduler)
    prefill = next(row for row in output.scheduled if row.seq is second)
    assert second.num_cached_prompt_tokens == 16 and prefill.num_new_tokens == 3
    [third] = make_request("third", range(20))  # wholly cached: only its last token is computed
    scheduler.add_request([third])
    output, _ = step(scheduler)
    prefill = next(row for row in output.scheduled if row.seq is third)
    assert third.num_cached_prompt_tokens == 19 and prefill.num_new_tokens == 1
    assert prefill.sample_for == [third]


@pytest.mark.parametrize("chunked,prefix", [(True, True), (True, False), (False, True), (False, False)])
def test_random_stress(chunked: bool, prefix: bool) -> None:
    rng = random.Random(1234 + 2 * chunked + prefix)
    max_model_len = 64
    scheduler = make_scheduler(num_blocks=24, budget=32, max_seqs=6, chunked=chunked, prefix=prefix,
                               max_model_len=max_model_len)
    stems = [[rng.randrange(50) for _ in range(16)] for _ in range(3)]
    requests: dict[str, list[Sequence]] = {}
    reported: list[Sequence] = []
    for number in range(400):
        if number < 300 and rng.random() < 0.4:
            length = rng.randint(1, 72)
            prompt = (rng.choice(stems) + [rng.randrange(50) for _ in range(length)])[:length]
            seqs = make_request(f"r{number}", prompt, max_tokens=rng.randint(1, 20), n=rng.choice([1, 1, 2, 3]))
            requests[seqs[0].request_id] = seqs
            scheduler.add_request(seqs)
        if rng.random() < 0.05 and requests:
            reported += scheduler.abort(rng.choice(list(requests)))
        reported += step(scheduler, max_model_len)[1]
    for _ in range(3000):
        if not scheduler.has_unfinished():
            break
        reported += step(scheduler, max_model_len)[1]
    every = [seq for seqs in requests.values() for seq in seqs]
    assert all(seq.is_finished for seq in every)
    assert set(reported) == set(every)
    for seq in every:
        if seq.finish_reason is FinishReason.LENGTH:
            assert len(seq.output_token_ids) == seq.params.max_tokens or len(seq) >= max_model_len
        elif seq.finish_reason is FinishReason.ERROR:
            assert seq.num_prompt_tokens > max_model_len
        else:
            assert seq.finish_reason is FinishReason.ABORT
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(manager.ref_count(block) == 0 for block in range(manager.num_blocks))
    assert scheduler.num_running == scheduler.num_waiting == 0


def _described(scheduler: Scheduler, output: SchedulerOutput) -> tuple:
    """An output and the state it leaves, by sequence ids (comparable across deep copies)."""
    rows = [(row.seq.seq_id, row.num_new_tokens, [seq.seq_id for seq in row.sample_for]) for row in output.scheduled]
    tables = {seq.seq_id: list(seq.block_table) for seq in scheduler.running}
    return (rows, output.block_copies, [seq.seq_id for seq in output.preempted],
            [seq.seq_id for seq in output.rejected], [seq.seq_id for seq in scheduler.running],
            [seq.seq_id for seq in scheduler.waiting], tables, scheduler.block_manager.num_free_blocks,
            scheduler.num_preemptions)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steady_decodes_schedule_what_the_phases_schedule(seed: int) -> None:
    """``schedule()`` hands the last step's rows again, saying so (``repeats``: the last output's ``step_id``),
    while every running sequence only decodes within its blocks (``_steady_decodes``); at every step of a
    mixed load (requests joining mid-decode, n > 1 forks, block boundaries crossed, a cache small enough to preempt, contexts that fill, an abort) a deep copy
    scheduled by the phases alone gives the same rows, copies, preemptions and state."""
    import copy

    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=14, budget=24, max_seqs=4, max_model_len=40)
    steady = phases = 0
    last_id = None
    for index in range(160):
        if index % 9 == 0 and index < 120:
            prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(1, 10))]
            scheduler.add_request(make_request(f"r{index}", prompt, max_tokens=rng.randrange(2, 40),
                                               n=rng.choice([1, 1, 2])))
        if index == 50 and scheduler.running:
            scheduler.abort(scheduler.running[0].request_id)
        reference = copy.deepcopy(scheduler)
        reference._decodes = None  # the phases only
        output = scheduler.schedule()
        expected = reference.schedule()
        assert _described(scheduler, output) == _described(reference, expected), index
        assert output.step_id != last_id and expected.repeats is None
        if output.repeats is not None:
            assert output.repeats == last_id and output.scheduled
            steady += 1
        else:
            phases += 1
        last_id = output.step_id
        for row in output.scheduled:
            for seq in row.sample_for:
                seq.output_token_ids.append(1000 + len(seq))
                if len(seq.output_token_ids) >= seq.params.max_tokens or len(seq) >= 40:
                    seq.finish(FinishReason.LENGTH)
        scheduler.update(output)
    assert steady >= 20 and phases >= 20, (steady, phases)
    assert scheduler.num_preemptions > 0
