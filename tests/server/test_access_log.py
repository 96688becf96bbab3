"""The access log: one INFO line per HTTP request (method, path, status, request id, tokens, time), on by
default, off with ``--no-access-log``; and the start-up line with the request defaults."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import urllib.request

import openai
import pytest

from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import MODEL_NAME, server_config, start_engine

LINE = re.compile(r"^(?P<method>\w+) (?P<path>\S+) (?P<status>\d{3}) (?P<id>\S+) prompt_tokens=(?P<prompt>\d+) "
                  r"completion_tokens=(?P<completion>\d+) (?P<ms>\d+\.\d) ms$")


@pytest.fixture(scope="module")
def servers(tiny_llama_checkpoint):
    checkpoint = tiny_llama_checkpoint[0]
    engine = start_engine(server_config(checkpoint))
    logged = BackgroundServer(engine, server_config(checkpoint))
    quiet = BackgroundServer(engine, server_config(checkpoint, **{"server.access_log": False}))
    yield logged, quiet
    logged.stop()
    quiet.stop()
    engine.shutdown()


def _lines(caplog: pytest.LogCaptureFixture) -> list[re.Match]:
    records = [r for r in caplog.records if r.name == "pluginfer.access"]
    assert all(r.levelno == logging.INFO for r in records)
    return [LINE.match(r.getMessage()) for r in records]


def test_each_request_is_one_line_with_its_id_and_the_tokens_its_usage_says(servers, caplog):
    logged, _ = servers
    client = openai.OpenAI(base_url=logged.url + "/v1", api_key="unused")
    with caplog.at_level(logging.INFO, logger="pluginfer.access"):
        chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        stream = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=1)
    first, second, third = _lines(caplog)
    assert first and first["method"] == "POST" and first["path"] == "/v1/chat/completions"
    assert (first["status"], first["id"]) == ("200", chat.id)
    assert (int(first["prompt"]), int(first["completion"])) == (chat.usage.prompt_tokens, 4)
    usage = chunks[-1].usage
    assert second and (second["path"], second["status"], second["id"]) == ("/v1/completions", "200", chunks[0].id)
    assert (int(second["prompt"]), int(second["completion"])) == (usage.prompt_tokens, 3)
    assert third and (third["status"], third["id"], third["prompt"]) == ("404", "-", "0")


def test_no_access_log_writes_none(servers, caplog):
    _, quiet = servers
    with caplog.at_level(logging.INFO, logger="pluginfer.access"):
        urllib.request.urlopen(quiet.url + "/v1/models", timeout=10).read()
    assert _lines(caplog) == []


def test_pluginfer_serve_logs_its_defaults_activations_and_each_request_by_default(tiny_llama_checkpoint):
    command = [sys.executable, "-m", "pluginfer", "serve", "--model", str(tiny_llama_checkpoint[0]), "--dtype",
               "float32", "--num-blocks", "64", "--block-size", "8", "--port", "0", "--default-top-k", "5",
               "--quant-activations", "float"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(server.stderr), daemon=True)
    reader.start()
    try:
        line = server.stdout.readline()
        assert "serving" in line, (line, "".join(stderr))
        url = line.strip().rsplit(" ", 1)[1]
        urllib.request.urlopen(url + "/v1/models", timeout=10).read()
    finally:
        server.terminate()
        server.wait(timeout=30)
        reader.join(10)
    text = "".join(stderr)
    assert ("pluginfer: request defaults: temperature=1 (built-in), top_p=1 (built-in), top_k=5 (config), "
            "min_p=0 (built-in), repetition_penalty=1 (built-in), max_tokens=256 (built-in)") in text, text
    assert ("pluginfer: GGUF-quantized linears take float activations (quant_activations; --quant-activations "
            "float: float32, exact as transformers; int8: as llama.cpp)") in text
    assert re.search(r"^INFO pluginfer\.access: GET /v1/models 200 - prompt_tokens=0 completion_tokens=0 [\d.]+ ms$",
                     text, re.MULTILINE), text
