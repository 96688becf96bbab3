"""The steady decode step's shortcuts (``Scheduler._steady_decodes``: the last step's rows again, said by
``repeats``; ``StepDataBuilder``: only each row's token and position sent; ``InputBatch``: the last step's
arrays written over, and the worker's last batch over them handed again) give the engine's outputs exactly as
the general path does: greedy tokens with logprobs, seeded sampling with
n > 1, stop strings, max_tokens, requests joining mid-decode, blocks of 4 tokens crossed every few steps,
and a cache small enough to preempt."""

from __future__ import annotations

import pytest

from pluginfer.engine.engine import LLMEngine
from pluginfer.engine.input_batch import InputBatch
from pluginfer.engine.scheduler import Scheduler
from pluginfer.engine.sequence import SamplingParams
from pluginfer.engine.step import StepDataBuilder
from pluginfer.engine.worker import Worker
from tests.engine.staggered import run_staggered
from tests.server.conftest import server_config

# (step at which it joins, prompt, params)
REQUESTS = {
    "greedy": (0, [11, 12, 13], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)),
    "n3": (0, [20, 21, 22], SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=14, logprobs=2)),
    "stop": (3, [40, 41, 42], SamplingParams(temperature=1.0, seed=3, max_tokens=24, stop=["a", "e", " "])),
    "late": (9, [50, 51, 52, 53, 54], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    "short": (12, [60, 61], SamplingParams(n=2, temperature=0.0, max_tokens=2, ignore_eos=True)),
    "long": (15, list(range(70, 90)), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
}


def _run(checkpoint: object, enforce_eager: bool) -> tuple[dict, int, int]:
    engine = LLMEngine(server_config(checkpoint, **{"scheduler.max_num_seqs": 8, "cache.num_blocks": 16,
                                                    "cache.block_size": 4, "max_model_len": 64,
                                                    "enforce_eager": enforce_eager}))
    finished, steps = run_staggered(engine, REQUESTS)
    return finished, engine.scheduler.num_preemptions, steps


@pytest.mark.parametrize("enforce_eager", [False, True])  # decode steps replayed, or every step eager
def test_steady_decode_shortcuts_give_the_general_paths_outputs(tiny_llama_checkpoint, monkeypatch,
                                                                enforce_eager: bool) -> None:
    steady = {"schedules": 0, "steps": 0, "arrays": 0, "batches": 0}
    original_schedule, original_repeat, original_update, original_batch = (
        Scheduler.schedule, StepDataBuilder._repeat, InputBatch.update, Worker._batch)

    def counted_schedule(self: Scheduler) -> object:
        output = original_schedule(self)
        steady["schedules"] += output.repeats is not None
        return output

    def counted_repeat(self: StepDataBuilder, *arguments: object) -> object:
        steady["steps"] += 1
        return original_repeat(self, *arguments)

    def counted_update(self: InputBatch, data: object) -> bool:
        reused = original_update(self, data)
        steady["arrays"] += reused
        return reused

    def counted_batch(self: Worker, arrays_reused: bool) -> object:
        last = self._last_batch
        batch = original_batch(self, arrays_reused)
        steady["batches"] += batch is last  # (the test's own count of the reuse the flag asked for)
        return batch

    def rebuilt(self: InputBatch, data: object) -> bool:
        self._apply_rows(data)
        self._build_arrays(data)
        return False

    with monkeypatch.context() as patch:  # the shortcuts as they run, counted
        patch.setattr(Scheduler, "schedule", counted_schedule)
        patch.setattr(StepDataBuilder, "_repeat", counted_repeat)
        patch.setattr(InputBatch, "update", counted_update)
        patch.setattr(Worker, "_batch", counted_batch)
        shortcut, shortcut_preemptions, shortcut_steps = _run(tiny_llama_checkpoint[0], enforce_eager)
    with monkeypatch.context() as patch:  # the general path only: every row compared, every array built anew
        patch.setattr(Scheduler, "_steady_decodes", lambda self: None)
        patch.setattr(StepDataBuilder, "build", lambda self, output: self._compare(output))
        patch.setattr(InputBatch, "update", rebuilt)
        general, general_preemptions, general_steps = _run(tiny_llama_checkpoint[0], enforce_eager)
    assert set(shortcut) == set(REQUESTS)
    assert shortcut == general
    assert (shortcut_preemptions, shortcut_steps) == (general_preemptions, general_steps)
    assert shortcut_preemptions > 0
    assert min(steady.values()) >= 5, steady  # each shortcut was taken
    assert [c[4] for c in shortcut["stop"]] == ["stop"] and len(shortcut["n3"]) == 3 and shortcut["greedy"][0][3]
