"""AsyncEngine (pluginfer/engine/async_engine.py): the step loop in a thread, driven from coroutines."""

from __future__ import annotations

import asyncio

import pytest

from pluginfer.engine.async_engine import AsyncEngine, EngineDeadError
from pluginfer.engine.sequence import SamplingParams
from tests.server.conftest import server_config, start_engine, wait_until_idle


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama_checkpoint):
    engine = start_engine(server_config(tiny_llama_checkpoint[0]))
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncEngine, prompt, params: SamplingParams, request_id: str | None = None):
    return [output async for output in engine.generate(prompt, params, request_id)]


def test_outputs_grow_until_the_last_is_finished(engine):
    outputs = asyncio.run(_collect(engine, "hello world", _greedy(5)))
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert len(outputs[-1].outputs[0].token_ids) == 5
    offline = engine.tokenizer.decode(outputs[-1].outputs[0].token_ids)
    assert outputs[-1].outputs[0].text == offline
    wait_until_idle(engine)


def test_concurrent_requests_match_sequential_ones(engine):
    prompts = [f"prompt {i}" for i in range(8)]

    async def together():
        return await asyncio.gather(*(_collect(engine, p, _greedy(6)) for p in prompts))

    alone = [asyncio.run(_collect(engine, p, _greedy(6)))[-1].outputs[0].token_ids for p in prompts]
    assert [outs[-1].outputs[0].token_ids for outs in asyncio.run(together())] == alone


def test_leaving_early_or_being_cancelled_aborts(engine):
    async def leave_after_two() -> None:
        count = 0
        async for _ in engine.generate("hello", _greedy(200)):
            count += 1
            if count == 2:
                break  # the generator is closed when collected; aclose makes it now

    async def cancel_soon() -> None:
        task = asyncio.create_task(_collect(engine, "hello", _greedy(200)))
        while not engine.num_requests or engine.num_waiting:  # until its first output: it is running
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def close_explicitly() -> None:
        stream = engine.generate("hello", _greedy(200))
        await stream.__anext__()
        await stream.aclose()

    for scenario in (leave_after_two, cancel_soon, close_explicitly):
        asyncio.run(scenario())
        wait_until_idle(engine, timeout=2)


def test_a_bad_prompt_fails_only_its_request(engine):
    async def main() -> None:
        with pytest.raises(ValueError, match="token ids"):
            await _collect(engine, [10**7], _greedy(2))
        error = (await _collect(engine, list(range(10, 310)), _greedy(2)))[-1]
        assert error.finished and "256" in error.error and error.outputs[0].finish_reason == "error"
        with pytest.raises(ValueError, match="in use"):
            await asyncio.gather(_collect(engine, "a", _greedy(50), "same"), _collect(engine, "b", _greedy(2), "same"))

    asyncio.run(main())
    assert engine.is_alive
    wait_until_idle(engine)


def test_shutdown_ends_requests_in_flight(engine):
    async def main() -> None:
        stream = engine.generate("hello", _greedy(200))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await _collect(engine, "again", _greedy(2))

    asyncio.run(main())
    assert not engine.is_alive and engine.error is None


def test_a_failing_step_kills_the_loop_and_says_why(engine):
    def broken() -> list:
        raise RuntimeError("device lost")

    engine.engine.step = broken

    async def main() -> None:
        with pytest.raises(EngineDeadError, match="device lost"):
            await _collect(engine, "hello", _greedy(2))

    asyncio.run(main())
    assert not engine.is_alive and isinstance(engine.error, RuntimeError)
