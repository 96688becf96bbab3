"""A step that raises fails only the requests it ran; the engine frees their blocks and goes on.

The fault is injected with the documented test option ``testing.fail_step_on_token_id``: a step
whose rows compute that token id raises before the forward.
"""

from __future__ import annotations

from pluginfer.engine.engine import LLMEngine
from pluginfer.engine.sequence import SamplingParams
from tests.server.conftest import server_config

FAULT = 7  # a prompt holding this token id makes its step raise


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine: LLMEngine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_a_failing_step_fails_only_its_requests_and_the_engine_goes_on(tiny_llama_checkpoint, caplog):
    engine = LLMEngine(server_config(tiny_llama_checkpoint[0], **{
        "testing.fail_step_on_token_id": FAULT, "scheduler.max_num_seqs": 3}))
    manager = engine.block_manager
    alone = LLMEngine(server_config(tiny_llama_checkpoint[0]))
    expected = {}
    for request_id, prompt in (("before", [11, 12, 13]), ("after", [20, 21, 22, 23])):
        alone.add_request(prompt, _greedy(6), request_id)
        expected[request_id] = _run(alone)[request_id].outputs[0].token_ids

    engine.add_request([11, 12, 13], _greedy(6), "before")
    engine.step()  # "before" runs alone: its prefill
    engine.add_request([30, FAULT, 31], SamplingParams(n=2, max_tokens=4), "faulty")
    after = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request([20, 21, 22, 23], after, "after")  # waits: three sequences run at most
    first = {output.request_id: output for output in engine.step()}  # "before" decodes, "faulty" prefills
    assert first["faulty"].finished and first["before"].finished
    for request_id in ("faulty", "before"):
        output = first[request_id]
        assert {choice.finish_reason for choice in output.outputs} == {"failed"}
        assert "injected fault" in output.error and "RuntimeError" in output.error
    assert "an engine step failed" in caplog.text

    finished = _run(engine)
    assert finished["after"].error is None
    assert [choice.token_ids for choice in finished["after"].outputs] == [expected["after"]] * 2
    assert manager.num_free_blocks == manager.num_blocks

    engine.add_request([11, 12, 13], _greedy(6), "again")  # the engine still serves
    assert _run(engine)["again"].outputs[0].token_ids == expected["before"]
    assert manager.num_free_blocks == manager.num_blocks
    engine.shutdown()
    alone.shutdown()


def test_a_fault_during_a_chunked_prefill_frees_the_chunks_already_computed(tiny_llama_checkpoint):
    engine = LLMEngine(server_config(tiny_llama_checkpoint[0], **{
        "testing.fail_step_on_token_id": FAULT, "scheduler.max_num_batched_tokens": 16}))
    manager = engine.block_manager
    prompt = list(range(10, 40)) + [FAULT] + list(range(40, 50))  # the fault is in the second chunk
    engine.add_request(prompt, _greedy(3), "long")
    outputs = _run(engine)
    assert outputs["long"].outputs[0].finish_reason == "failed"
    assert manager.num_free_blocks == manager.num_blocks
    engine.shutdown()
