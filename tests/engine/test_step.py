"""StepDataBuilder and InputBatch: a worker's persistent batch, updated from each step's data (rows added,
removed, continued, preempted, blocks gained), holds the arrays a step built from scratch would hold, at every
step of a mixed load; the step data says which rows are new, which left and when the rows are the last step's."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from pluginfer.engine.input_batch import InputBatch
from pluginfer.engine.sequence import FinishReason, SamplingParams, Sequence
from pluginfer.engine.step import NewRow, StepData, StepDataBuilder
from tests.engine.test_scheduler import BLOCK, make_request, make_scheduler

FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "logits_indices")


def from_scratch(scheduled: list, extra_rows: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """The step's arrays token by token from the sequences themselves (the oracle)."""
    ids, positions, slots, starts, seq_lens, sampled = [], [], [], [0], [], []
    for row in scheduled:
        seq, first = row.seq, row.seq.num_computed_tokens
        for position in range(first, first + row.num_new_tokens):
            ids.append(seq.token_ids[position])
            positions.append(position)
            slots.append(seq.block_table[position // BLOCK] * BLOCK + position % BLOCK)
        starts.append(starts[-1] + row.num_new_tokens)
        seq_lens.append(first + row.num_new_tokens)
        if row.sample_for:
            sampled.append(starts[-1] - 1)
    width = -(-max(seq_lens) // BLOCK)
    tables = [(row.seq.block_table[:width] + [0] * width)[:width] for row in scheduled]
    logits = sampled + [flat for start, count in extra_rows for flat in range(start, start + count)]
    arrays = dict(input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=starts, seq_lens=seq_lens,
                  block_tables=tables, logits_indices=logits)
    return {name: np.array(value, np.int64).reshape(len(scheduled), width) if name == "block_tables"
            else np.array(value, np.int64) for name, value in arrays.items()}


def assert_batch_equals(batch: InputBatch, expected: dict[str, np.ndarray]) -> None:
    for name in FIELDS:
        array = getattr(batch, name)
        assert array.dtype == np.int64 and array.flags.c_contiguous, name
        assert np.array_equal(array, expected[name]), (name, array, expected[name])
    assert batch.max_seq_len == int(expected["seq_lens"].max())
    forward = batch.to_batch(torch.device("cpu"))
    lens = np.diff(expected["query_start_loc"])
    assert forward.query_lens == lens.tolist() and forward.max_query_len == int(lens.max())
    assert np.shares_memory(forward.block_tables.numpy(), batch.block_tables)  # no copy on the CPU


def sample(output: object) -> None:
    """The fake sampling of test_scheduler.step on an output already scheduled."""
    for row in output.scheduled:
        for seq in row.sample_for:
            seq.output_token_ids.append(1000 + len(seq))
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                seq.finish(FinishReason.LENGTH)


@pytest.mark.parametrize("seed", [0, 1])
def test_persistent_batch_equals_building_from_scratch(seed: int) -> None:
    """Requests join mid-decode, finish, fork (n = 3), ask for prompt logprobs, cross blocks of 4 tokens and
    are preempted by a small cache; at every step the driver's worker and a second rank that reads the
    pickled step (the broadcast) hold the arrays built from scratch, and the steady steps write over the last
    step's arrays."""
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=16, budget=32, max_seqs=4, max_model_len=60)
    builder, driver, other = StepDataBuilder(BLOCK), InputBatch(BLOCK), InputBatch(BLOCK)
    seen = {"repeats": 0, "reused": 0, "new_rows": 0, "removed": 0, "new_blocks": 0, "same_rows": 0, "extra": 0}
    for index in range(160):
        if index % 20 == 0 and index < 120:
            prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(1, 10))]
            params = SamplingParams(n=rng.choice([1, 3]), max_tokens=rng.randrange(2, 40),
                                    prompt_logprobs=1 if index % 40 == 0 else None)
            scheduler.add_request([Sequence(f"r{index}", prompt, params, index=i) for i in range(params.n)])
        output = scheduler.schedule()
        if output.scheduled:
            plan = builder.build(output)
            data = plan.data
            reused = driver.update(data)
            assert other.update(pickle.loads(pickle.dumps(data))) == reused
            expected = from_scratch(output.scheduled, data.extra_rows)
            assert_batch_equals(driver, expected)
            assert_batch_equals(other, expected)
            assert driver.seq_ids == [row.seq.seq_id for row in output.scheduled]
            for row in output.scheduled:
                assert driver.block_ids(row.seq.seq_id) == row.seq.block_table
            sampling = [seq for row in output.scheduled for seq in row.sample_for]
            assert plan.sample_seqs == sampling and len(plan.sample_rows) == len(sampling)
            seen["repeats"] += output.repeats is not None
            seen["reused"] += reused
            seen["new_rows"] += bool(data.new_rows)
            seen["removed"] += bool(data.removed_ids)
            seen["new_blocks"] += bool(data.new_block_ids)
            seen["same_rows"] += data.same_rows
            seen["extra"] += bool(data.extra_rows)
        sample(output)
        scheduler.update(output)
    assert scheduler.num_preemptions > 0
    assert seen.pop("extra") >= 1 and min(seen.values()) >= 3, seen


def test_step_data_names_new_continuing_and_removed_rows() -> None:
    """A prefill enters as a new row with its whole table; its decodes continue it (new blocks only when it
    takes one); a second request joins as a new row; a preempted sequence is removed, and enters again as a
    new row; a finished one is removed."""
    scheduler = make_scheduler(num_blocks=5, budget=64, max_seqs=4)
    builder = StepDataBuilder(BLOCK)

    def run() -> StepData:
        output = scheduler.schedule()
        data = builder.build(output).data
        sample(output)
        scheduler.update(output)
        return data

    [a] = make_request("a", range(10, 16), max_tokens=9)  # 6 tokens: 2 blocks
    scheduler.add_request([a])
    data = run()
    assert [(row.seq_id, row.block_ids) for row in data.new_rows] == [(a.seq_id, a.block_table)]
    assert data.token_ids == list(range(10, 16)) and data.num_new_tokens == [6] and not data.same_rows
    data = run()  # position 6, in its second block
    assert data.new_rows == [] and data.same_rows and data.num_computed_tokens == [6] and data.num_new_tokens is None
    data = run()  # position 7
    assert data.same_rows and data.token_ids == [a.token_ids[7]] and data.seq_ids == []
    data = run()  # position 8: a third block
    assert data.new_block_ids == [(a.seq_id, a.block_table[2:])] and data.same_rows
    [b] = make_request("b", range(20, 26), max_tokens=8)
    scheduler.add_request([b])
    data = run()
    assert data.seq_ids == [a.seq_id, b.seq_id] and [row.seq_id for row in data.new_rows] == [b.seq_id]
    assert not data.same_rows and data.num_new_tokens == [1, 6] and data.sampled_rows is None
    events = []  # a takes a 4th block at position 12: b (the newest) is preempted
    for _ in range(30):
        data = run()
        events += [("removed", seq_id) for seq_id in data.removed_ids]
        events += [("new", row.seq_id, len(row.block_ids)) for row in data.new_rows]
        if not scheduler.has_unfinished():
            break
    assert scheduler.num_preemptions == 1 and a.is_finished and b.is_finished
    # b leaves when preempted, a when it finishes; b comes back as a new row whose table covers its recompute
    # (its prompt and the tokens it had: 9 or more, 3 blocks); no step follows b's end to remove it
    assert events == [("removed", b.seq_id), ("removed", a.seq_id), ("new", b.seq_id, 3)]


def test_a_step_the_worker_cannot_apply_is_a_clear_error_and_a_reset_starts_over() -> None:
    batch = InputBatch(BLOCK)
    batch.update(StepData(token_ids=[1, 2, 3], num_computed_tokens=[0], block_size=BLOCK, num_new_tokens=[3],
                          seq_ids=[7], new_rows=[NewRow(7, [5])]))
    with pytest.raises(RuntimeError, match="continues sequence 8"):
        batch.update(StepData(token_ids=[4], num_computed_tokens=[3], block_size=BLOCK, seq_ids=[8]))
    with pytest.raises(RuntimeError, match="removes sequence 9"):
        batch.update(StepData(token_ids=[4], num_computed_tokens=[3], block_size=BLOCK, seq_ids=[7], removed_ids=[9]))
    with pytest.raises(RuntimeError, match="new blocks to sequence 6"):
        batch.update(StepData(token_ids=[4], num_computed_tokens=[3], block_size=BLOCK, seq_ids=[7],
                              new_block_ids=[(6, [1])]))
    with pytest.raises(RuntimeError, match="sequence 7 reaches position 4, past the 1 blocks"):
        batch.update(StepData(token_ids=[4, 5], num_computed_tokens=[3], block_size=BLOCK, num_new_tokens=[2],
                              seq_ids=[7]))
    batch.update(StepData(token_ids=[9], num_computed_tokens=[0], block_size=BLOCK, seq_ids=[3],
                          new_rows=[NewRow(3, [2])], reset=True))
    assert batch.seq_ids == [3] and batch.slot_mapping.tolist() == [2 * BLOCK]


def test_a_forgotten_batch_is_sent_again_whole() -> None:
    """After ``forget`` (a step raised), the next step resets the workers' rows and sends every row as new."""
    scheduler = make_scheduler(budget=64)
    scheduler.add_request(make_request("a", range(10, 20), max_tokens=8))
    builder, batch = StepDataBuilder(BLOCK), InputBatch(BLOCK)
    for _ in range(4):  # the prefill, then positions 10 to 12 (a block taken)
        output = scheduler.schedule()
        batch.update(builder.build(output).data)
        sample(output)
        scheduler.update(output)
    builder.forget()
    output = scheduler.schedule()
    assert output.repeats is not None  # the scheduler repeats its rows, the builder no longer trusts the workers
    data = builder.build(output).data
    assert data.reset and not data.same_rows and [row.seq_id for row in data.new_rows] == data.seq_ids
    fresh = InputBatch(BLOCK)
    fresh.update(data)
    batch.update(data)
    assert_batch_equals(batch, from_scratch(output.scheduled, []))
    assert_batch_equals(fresh, from_scratch(output.scheduled, []))
