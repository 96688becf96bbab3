"""ClientRequest: a request's output on the server's side of the engine core process, grown by step deltas.

A consumer that keeps up sees every step's output; one that falls behind gets one output with everything new
since it last looked (not a queue of stale ones), and a failure wakes a waiting consumer.
"""

import asyncio

import pytest

from pluginfer.engine.messages import ChoiceDelta, PromptInfo, RequestDelta
from pluginfer.server.client_request import ClientRequest


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _delta(choices: list[ChoiceDelta], finished: bool = False, prompt: PromptInfo | None = None) -> RequestDelta:
    return RequestDelta("r", prompt, choices, finished, None, 0, None)


def _step(request: ClientRequest, tokens: list[int], text: str, finished: bool = False) -> None:
    request.apply(_delta([ChoiceDelta(0, tokens, text, None, "stop" if finished else None)], finished))


def test_a_consumer_that_keeps_up_sees_each_step(loop):
    request = ClientRequest(loop, [1, 2], n=1)
    seen = []
    for token, text in [(5, "a"), (6, "b"), (7, "c")]:
        _step(request, [token], text, finished=token == 7)
        assert request.fresh
        seen.append(request.snapshot("r").outputs[0].text)
        assert not request.fresh
    assert seen == ["a", "ab", "abc"]


def test_a_consumer_that_falls_behind_gets_one_output_with_all_that_is_new(loop):
    request = ClientRequest(loop, "hi", n=1)
    _step(request, [5], '{"ci')
    _step(request, [6], 'ty": ')
    _step(request, [7], '"Oslo"}', finished=True)
    output = request.snapshot("r")
    assert output.finished and output.prompt == "hi"
    assert output.outputs[0].token_ids == [5, 6, 7] and output.outputs[0].text == '{"city": "Oslo"}'
    assert output.outputs[0].finish_reason == "stop" and not request.fresh


def test_a_snapshot_is_not_changed_by_later_steps(loop):
    request = ClientRequest(loop, [1], n=2)
    request.apply(_delta([ChoiceDelta(0, [5], "a", None, None), ChoiceDelta(1, [9], "z", None, None)]))
    first = request.snapshot("r")
    request.apply(_delta([ChoiceDelta(1, [8], "y", None, "length")], finished=True))
    assert [c.token_ids for c in first.outputs] == [[5], [9]] and not first.finished
    assert [c.text for c in request.snapshot("r").outputs] == ["a", "zy"]


@pytest.mark.parametrize("event", ["delta", "failure"])
def test_a_waiting_consumer_is_woken(event):
    async def wait() -> None:
        request = ClientRequest(asyncio.get_running_loop(), [1], n=1)
        request.waiter = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(
            lambda: _step(request, [5], "a") if event == "delta" else request.fail(RuntimeError("gone")))
        await asyncio.wait_for(request.waiter, 5)
        assert (request.fresh, request.failure is None) == ((True, True) if event == "delta" else (False, False))

    asyncio.run(wait())


def test_the_first_delta_brings_the_prompt_and_logprobs_accumulate(loop):
    request = ClientRequest(loop, "hi there", n=1)
    prompt = PromptInfo("hi there", [7, 8], [None, {8: -0.5}])
    request.apply(_delta([ChoiceDelta(0, [5], "a", [{5: -0.1}], None)], prompt=prompt))
    request.apply(_delta([ChoiceDelta(0, [6], "b", [{6: -0.2}], "length")], finished=True))
    output = request.snapshot("r")
    assert output.prompt_token_ids == [7, 8] and output.prompt_logprobs == [None, {8: -0.5}]
    assert output.outputs[0].logprobs == [{5: -0.1}, {6: -0.2}] and output.outputs[0].text == "ab"
