"""``pluginfer bench serve`` and ``pluginfer chat --base-url`` against a real ``pluginfer serve`` process.

tests/test_bench_client.py checks their arithmetic and error handling against a fake server; here they meet
the real one (its engine core process, its /v1/models, its token-id validation, its usage chunks) on a tiny
model, so a mismatch between the clients and the server fails a test."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest

from pluginfer.cli import main

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tiny_llama_checkpoint, tmp_path_factory) -> Iterator[str]:
    """The URL of ``pluginfer serve`` on the tiny llama, as a user starts it."""
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "pluginfer", "serve", "--model", str(tiny_llama_checkpoint[0]),
             "--dtype", "float32", "--port", "0", "--served-model-name", MODEL, "--num-blocks", "128",
             "--block-size", "8"],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = process.stdout.readline()
        assert "serving" in line, (line, log.read_text())
        yield line.split(" on ")[-1].strip()
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0, log.read_text()


def test_bench_serve_measures_a_real_server(served, tmp_path, capsys):
    out = tmp_path / "bench.json"
    status = main(["bench", "serve", "--base-url", served, "--concurrency", "3", "--input-len", "7",
                   "--output-len", "5", "--num-prompts", "6", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert status == 0, figures
    assert figures["model"] == MODEL and figures["vocab_size"] > 0  # what /v1/models says
    assert (figures["successful_requests"], figures["failed_requests"]) == (6, 0)
    # ignore_eos: every request generates exactly its output length; usage counts the prompt's tokens
    assert (figures["total_input_tokens"], figures["total_output_tokens"]) == (6 * 7, 6 * 5)
    assert all(r["ok"] and r["output_tokens"] == 5 for r in figures["requests"])
    for name in ["ttft_ms", "itl_ms", "e2e_latency_ms"]:
        assert figures[name]["p99"] >= figures[name]["median"] > 0, name
    assert "Successful requests:" in capsys.readouterr().out


def test_remote_chat_talks_to_a_real_server(served, monkeypatch, capsys):
    """Two greedy turns through ``pluginfer chat --base-url``; each answer is what the server gives the
    official client for the same conversation."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nand again\n\n"))
    status = main(["chat", "--base-url", served, "--system", "be brief", "--max-tokens", "6",
                   "--temperature", "0"])
    assert status == 0
    printed = capsys.readouterr().out
    answers = []
    with openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=120) as client:
        messages = [{"role": "system", "content": "be brief"}]
        for turn in ["hello there", "and again"]:
            messages.append({"role": "user", "content": turn})
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
            assert reply.usage.completion_tokens > 0
            answers.append(reply.choices[0].message.content)
            messages.append({"role": "assistant", "content": answers[-1]})
    assert printed == "".join(f"{answer}\n" for answer in answers)


def test_remote_chat_on_a_terminal_names_the_model_its_sampling_and_a_cut_answer(served, monkeypatch, capsys):
    """The banner shows the sampling the answers take: the flags given, else the server's defaults (its
    /v1/models ``sampling_defaults``, read here with the official client); the cut answer is marked."""
    stdin = io.StringIO("hello there\n\n")
    stdin.isatty = lambda: True  # as on a terminal: banner and marks
    monkeypatch.setattr("sys.stdin", stdin)
    status = main(["chat", "--base-url", served, "--max-tokens", "2", "--temperature", "0.5", "--ignore-eos"])
    assert status == 0
    with openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=120) as client:
        defaults = client.models.list().data[0].model_extra["sampling_defaults"]
    err = capsys.readouterr().err
    assert (f"pluginfer chat with {MODEL} (temperature 0.5, top_p {defaults['top_p']:g}, top_k {defaults['top_k']}, "
            f"min_p {defaults['min_p']:g}, repetition_penalty {defaults['repetition_penalty']:g}): an empty line") in err
    assert "[stopped at the token limit (--max-tokens 2)]" in err
