"""The steady decode step's shortcuts (``Scheduler._steady_decodes``: the last step's rows again;
``StepBuilder``: the last step's arrays written over; ``Worker._batch``: the last batch over those arrays) give
the engine's outputs exactly as the general path does: greedy tokens with logprobs, seeded sampling with
n > 1, stop strings, max_tokens, requests joining mid-decode, blocks of 4 tokens crossed every few steps,
and a cache small enough to preempt."""

from __future__ import annotations

import pytest

from pluginfer.engine import step as step_module
from pluginfer.engine.engine import LLMEngine
from pluginfer.engine.scheduler import Scheduler
from pluginfer.engine.sequence import SamplingParams
from pluginfer.engine.worker import Worker
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
    finished, step = {}, 0
    try:
        while step < 20 or engine.has_unfinished_requests():
            for request_id, (joins, prompt, params) in REQUESTS.items():
                if joins == step:
                    engine.add_request(prompt, params, request_id)
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason)
                                                   for c in output.outputs]
            step += 1
        return finished, engine.scheduler.num_preemptions, step
    finally:
        engine.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True])  # decode steps replayed, or every step eager
def test_steady_decode_shortcuts_give_the_general_paths_outputs(tiny_llama_checkpoint, monkeypatch,
                                                                enforce_eager: bool) -> None:
    steady = {"schedules": 0, "steps": 0, "batches": 0}
    original_decodes, original_build, original_batch = (Scheduler._steady_decodes, step_module.StepBuilder.build,
                                                        Worker._batch)

    def counted_decodes(self: Scheduler) -> object:
        output = original_decodes(self)
        steady["schedules"] += output is not None
        return output

    def counted_build(self: object, scheduled: list, block_copies: object = None) -> object:
        last = self._plan
        plan = original_build(self, scheduled, block_copies)
        steady["steps"] += plan is last
        return plan

    def counted_batch(self: Worker, step: object) -> object:
        last = self._last_batch
        batch = original_batch(self, step)
        steady["batches"] += batch is last
        return batch

    with monkeypatch.context() as patch:  # the shortcuts as they run, counted
        patch.setattr(Scheduler, "_steady_decodes", counted_decodes)
        patch.setattr(step_module.StepBuilder, "build", counted_build)
        patch.setattr(Worker, "_batch", counted_batch)
        shortcut, shortcut_preemptions, shortcut_steps = _run(tiny_llama_checkpoint[0], enforce_eager)
    with monkeypatch.context() as patch:  # the general path only
        patch.setattr(Scheduler, "_steady_decodes", lambda self: None)
        patch.setattr(step_module.StepBuilder, "build",
                      lambda self, scheduled, block_copies=None: step_module.build_step(scheduled, self.block_size,
                                                                                       block_copies))
        patch.setattr(Worker, "_batch", lambda self, step: step.to_batch(self.backend.device))
        general, general_preemptions, general_steps = _run(tiny_llama_checkpoint[0], enforce_eager)
    assert set(shortcut) == set(REQUESTS)
    assert shortcut == general
    assert (shortcut_preemptions, shortcut_steps) == (general_preemptions, general_steps)
    assert shortcut_preemptions > 0
    assert min(steady.values()) >= 5, steady  # each shortcut was taken
    assert [c[4] for c in shortcut["stop"]] == ["stop"] and len(shortcut["n3"]) == 3 and shortcut["greedy"][0][3]
