"""build_step: the plain-Python decode path gives the general numpy path's arrays exactly, and steps it does
not cover (prefill chunks, prompt logprobs, n > 1 parents) still take the general path; ``to_batch`` gives
every step's query lengths as ``np.diff`` does."""

from __future__ import annotations

import random

import numpy as np
import torch

from pluginfer.engine.sequence import FinishReason, SamplingParams, Sequence
from pluginfer.engine.step import StepBuilder, _flatten, _plain_decode_step, build_step
from tests.engine.test_scheduler import BLOCK, make_request, make_scheduler, step

FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "logits_indices")


def assert_same_plan(plain: object, general: object) -> None:
    for name in FIELDS:
        a, b = getattr(plain.step, name), getattr(general.step, name)
        assert a.dtype == b.dtype == np.int64 and a.flags.c_contiguous and np.array_equal(a, b), name
    assert (plain.step.block_size, plain.step.block_copies, plain.step.num_hidden_rows) == \
        (general.step.block_size, general.step.block_copies, general.step.num_hidden_rows)
    assert plain.prompt_logprob_rows == general.prompt_logprob_rows == []
    assert plain.pooling_rows == general.pooling_rows == []
    batches = plain.step.to_batch(torch.device("cpu")), general.step.to_batch(torch.device("cpu"))
    assert batches[0].max_seq_len == batches[1].max_seq_len == int(general.step.seq_lens.max())  # carried, computed


def test_plain_decode_steps_equal_the_general_path() -> None:
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=200, budget=64, max_seqs=6)
    plain_steps = 0
    for index in range(40):
        if index % 5 == 0:  # requests join while others decode, finish at different lengths
            prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(1, 12))]
            scheduler.add_request(make_request(f"r{index}", prompt, max_tokens=rng.randrange(2, 30)))
        output = scheduler.schedule()
        plain = _plain_decode_step(output.scheduled, BLOCK, output.block_copies)
        general = _flatten(output.scheduled, BLOCK, output.block_copies)
        decoding = all(row.num_new_tokens == 1 and row.sample_for for row in output.scheduled)
        assert (plain is not None) == (decoding and bool(output.scheduled))
        if plain is not None:
            plain_steps += 1
            assert_same_plan(plain, general)
        if output.scheduled:  # to_batch: a decode step's lengths without numpy, the others' by np.diff
            batch, lens = general.step.to_batch(torch.device("cpu")), np.diff(general.step.query_start_loc)
            assert batch.query_lens == lens.tolist() and batch.max_query_len == int(lens.max())
            assert batch.max_seq_len == int(general.step.seq_lens.max())
            assert np.shares_memory(batch.block_tables.numpy(), general.step.block_tables)  # no copy on the CPU
        for row in output.scheduled:  # what step() in test_scheduler does, on this output
            for seq in row.sample_for:
                seq.output_token_ids.append(1000 + len(seq))
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.finish(FinishReason.LENGTH)
        scheduler.update(output)
    assert plain_steps >= 10


def advance(scheduler: object, output: object) -> None:
    """The fake sampling of test_scheduler.step on an output already scheduled, then update()."""
    for row in output.scheduled:
        for seq in row.sample_for:
            seq.output_token_ids.append(1000 + len(seq))
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                seq.finish(FinishReason.LENGTH)
    scheduler.update(output)


def test_steps_the_plain_path_leaves_to_the_general_one() -> None:
    scheduler = make_scheduler(budget=64)
    scheduler.add_request(make_request("a", range(10, 20), max_tokens=5))
    output = scheduler.schedule()  # a prefill of 10 tokens
    assert _plain_decode_step(output.scheduled, BLOCK, []) is None
    advance(scheduler, output)
    output = scheduler.schedule()  # now a decode
    assert _plain_decode_step(output.scheduled, BLOCK, []) is not None
    advance(scheduler, output)
    with_logprobs = Sequence("b", list(range(30, 40)), SamplingParams(max_tokens=3, prompt_logprobs=1))
    scheduler.add_request([with_logprobs])
    step(scheduler)
    output = scheduler.schedule()  # both decode; one asked for prompt logprobs
    assert [row.num_new_tokens for row in output.scheduled] == [1, 1]
    assert _plain_decode_step(output.scheduled, BLOCK, []) is None
    plan, general = build_step(output.scheduled, BLOCK, []), _flatten(output.scheduled, BLOCK, [])
    assert all(np.array_equal(getattr(plan.step, name), getattr(general.step, name)) for name in FIELDS)


def test_step_builder_reuses_its_arrays_as_build_step_would_fill_them() -> None:
    """``StepBuilder`` writes a steady decode step (the scheduler's same rows again) into the last step's
    arrays: at every step of a load with requests joining, finishing, forking (n > 2), crossing block
    boundaries and preempted by a small cache, its plan equals a fresh ``build_step`` of the same rows, the
    carried ``max_seq_len`` included; and it does reuse the arrays (the same ``StepInput``) in the steady
    steps."""
    rng = random.Random(1)
    scheduler = make_scheduler(num_blocks=16, budget=32, max_seqs=4, max_model_len=60)
    builder = StepBuilder(BLOCK)
    reused = fresh = 0
    last = None
    for index in range(150):
        if index % 20 == 0 and index < 120:
            prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(1, 10))]
            scheduler.add_request(make_request(f"r{index}", prompt, max_tokens=rng.randrange(2, 40),
                                               n=rng.choice([1, 3])))
        output = scheduler.schedule()
        if not output.scheduled:
            advance(scheduler, output)
            continue
        plan = builder.build(output.scheduled, output.block_copies)
        general = build_step(output.scheduled, BLOCK, output.block_copies)
        for name in FIELDS:
            assert np.array_equal(getattr(plan.step, name), getattr(general.step, name)), (index, name)
        assert plan.step.to_batch(torch.device("cpu")).max_seq_len == int(general.step.seq_lens.max())
        assert (plan.step.block_copies, plan.prompt_logprob_rows, plan.pooling_rows) == \
            (general.step.block_copies, general.prompt_logprob_rows, general.pooling_rows)
        if plan.step is last:
            reused += 1
        else:
            fresh += 1
        last = plan.step
        advance(scheduler, output)
    assert reused >= 10 and fresh >= 20, (reused, fresh)  # blocks of 4 tokens: most steps cross one
    assert scheduler.num_preemptions > 0
