"""The soak of benchmarks/soak.py, short (30 s) for CI: 64 streaming clients over the engine core process,
a fifth of them leaving mid-stream, some cancelling, some with n > 1 and stop strings. None may fail, and every
KV block is free at the end. The long run and its figures: docs/reliability.md."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from pluginfer.server.core_client import CoreProcessClient
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import server_config

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_30_second_soak_loses_nothing(tiny_llama_checkpoint):
    soak = _soak_module()
    config = server_config(tiny_llama_checkpoint[0], **{"scheduler.max_num_seqs": 64, "cache.num_blocks": 512})
    engine = CoreProcessClient(config).start()
    server = BackgroundServer(engine, config)
    try:
        args = soak.parse_args(["--url", server.url, "--duration", "30", "--clients", "64", "--max-prompt", "80",
                                "--max-output", "64", "--seed", "15"])
        report = asyncio.run(soak.soak(server.url, args))
    finally:
        server.stop()
        engine.shutdown()
    summary = report.summary()
    assert report.failed == 0, report.failures
    assert report.completed > 0 and report.disconnected > 0, summary
    assert summary["all_blocks_free"], summary
    assert summary["ttft_ms_p50"] is not None and summary["itl_ms_p50"] is not None
