"""``LLMEngine.step(only_finished=True)`` (what ``LLM.generate`` calls): only finished requests' outputs,
each equal to the one the default step returns, with n > 1, stop strings, logprobs and seeds."""

from __future__ import annotations

from pluginfer.engine.engine import LLMEngine
from pluginfer.engine.sequence import SamplingParams
from tests.server.conftest import server_config

REQUESTS = {
    "greedy": ([11, 12, 13], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
    "n3": ([20, 21, 22], SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=7, logprobs=2)),
    "short": ([30, 31], SamplingParams(n=2, temperature=0.0, max_tokens=2, ignore_eos=True)),
    "stop": ([40, 41, 42], SamplingParams(temperature=1.0, seed=3, max_tokens=24, stop=["a", "e", " "])),
}


def _run(engine: LLMEngine, only_finished: bool) -> tuple[dict, int]:
    for request_id, (prompt, params) in REQUESTS.items():
        engine.add_request(prompt, params, request_id)
    finished, unfinished_seen = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step(only_finished=only_finished):
            if output.finished:
                finished[output.request_id] = output
            else:
                unfinished_seen += 1
    return finished, unfinished_seen


def test_only_finished_outputs_equal_the_default_steps(tiny_llama_checkpoint):
    engine = LLMEngine(server_config(tiny_llama_checkpoint[0], **{"scheduler.max_num_seqs": 8}))
    every, unfinished_every = _run(engine, only_finished=False)
    final, unfinished_final = _run(engine, only_finished=True)
    engine.shutdown()
    assert unfinished_every > 0 and unfinished_final == 0
    assert set(every) == set(final) == set(REQUESTS)
    for request_id, output in every.items():
        other = final[request_id]
        assert [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason) for c in output.outputs] == \
            [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason) for c in other.outputs]
        assert output.error is None and other.error is None
    assert len(every["n3"].outputs) == 3 and every["n3"].outputs[0].logprobs
    assert [c.finish_reason for c in every["short"].outputs] == ["length", "length"]
    assert every["stop"].outputs[0].finish_reason == "stop"  # cut at a stop string (the held text flushed)
