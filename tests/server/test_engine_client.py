"""The EngineClient protocol (pluginfer/engine/client.py): both engines the server runs over implement it, agree
on what they report through it, and the server reaches the engine through nothing else."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest

import pluginfer.server
from pluginfer.engine.async_engine import AsyncEngine
from pluginfer.engine.client import ENGINE_CLIENT_MEMBERS, EngineClient
from pluginfer.engine.sequence import SamplingParams
from pluginfer.server.core_client import CoreProcessClient
from tests.server.conftest import server_config, start_engine, wait_until_idle

IMPLEMENTATIONS = [AsyncEngine, CoreProcessClient]


def test_the_member_list_is_the_protocols():
    declared = {name for name in vars(EngineClient) if not name.startswith("_")}
    assert declared == set(ENGINE_CLIENT_MEMBERS)


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_implementation_has_every_member_in_the_protocols_form(cls):
    """A property where the protocol has one (the value read), a method where it has one, with its parameters."""
    for name in ENGINE_CLIENT_MEMBERS:
        wanted = inspect.getattr_static(EngineClient, name)
        found = inspect.getattr_static(cls, name, None)
        assert found is not None, f"{cls.__name__} lacks {name}"
        if isinstance(wanted, property):
            assert isinstance(found, property), f"{cls.__name__}.{name} is not a property"
        else:
            assert callable(found), f"{cls.__name__}.{name} is not a method"
            assert list(inspect.signature(found).parameters) == list(inspect.signature(wanted).parameters), name


def _run(client: EngineClient, prompt: list[int]) -> int:
    """The prompt's tokens found in the prefix cache, as its output says."""
    async def go() -> int:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        outputs = [output async for output in client.generate(prompt, params)]
        return outputs[-1].num_cached_tokens

    return asyncio.run(go())


@pytest.fixture(scope="module")
def both(tiny_llama_checkpoint):
    config = server_config(tiny_llama_checkpoint[0])
    engines = [start_engine(config), CoreProcessClient(config).start()]
    yield engines
    for engine in engines:
        engine.shutdown()


def test_both_engines_are_engine_clients_and_report_alike(both):
    """The same config: the same ModelInfo; a prompt run twice, the second time from the prefix cache, moves
    both engines' counters by what the outputs report, and both go back to idle."""
    prompt = list(range(10, 45))  # 35 tokens: four full blocks of 8 to reuse
    reports = []
    for client in both:
        assert isinstance(client, EngineClient)
        before = client.stats
        first, second = _run(client, prompt), _run(client, prompt)
        wait_until_idle(client)
        after = client.stats
        assert (first, second) == (0, 32)
        assert after.prefix_cache_queries - before.prefix_cache_queries == 2 * len(prompt)
        assert after.prefix_cache_hits - before.prefix_cache_hits == second
        assert (after.num_running, after.num_waiting, after.kv_cache_usage) == (0, 0, 0.0)
        assert after.num_free_blocks == after.num_blocks == client.model_info.num_blocks
        reports.append(client.model_info)
    assert reports[0] == reports[1] and reports[0].max_model_len == 256 and reports[0].block_size == 8
    assert both[0].tokenizer.encode("hello world") == both[1].tokenizer.encode("hello world")


_ENGINE_INTERNALS = {"pluginfer.engine.engine", "pluginfer.engine.async_engine", "pluginfer.engine.scheduler",
                     "pluginfer.engine.kv_cache", "pluginfer.engine.worker", "pluginfer.engine.executor",
                     "pluginfer.engine.step", "pluginfer.engine.engine_core"}


def test_the_server_imports_no_engine_internals():
    """Handlers and metrics reach the engine through EngineClient; only launch.py builds the in-process one."""
    offenders = []
    for path in sorted(Path(pluginfer.server.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in _ENGINE_INTERNALS:
                if not (path.name == "launch.py" and node.module in ("pluginfer.engine.engine",
                                                                    "pluginfer.engine.async_engine")):
                    offenders.append(f"{path.name}: {node.module}")
    assert offenders == []
