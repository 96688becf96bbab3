"""A GGUF file is served under its stem (its file name and path are accepted too); the server's paths stay out
of ``/v1/models`` and of the errors clients get."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from pluginfer.core.config import build_config
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import start_engine

GGUF = Path(__file__).parents[1] / "quant" / "fixtures" / "llamacpp-qwen2-q8_0.gguf"


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "x.gguf"
    shutil.copy(GGUF, path)
    config = build_config(model=str(path), **{"cache.num_blocks": 32, "cache.block_size": 8, "server.port": 0})
    engine = start_engine(config)
    server = BackgroundServer(engine, config)
    yield server, path
    server.stop()
    engine.shutdown()


def test_a_gguf_is_served_under_its_stem_and_answers_to_its_file_name_and_path(gguf_server):
    server, path = gguf_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    [card] = client.models.list().data
    assert (card.id, card.model_extra["root"]) == ("x", "x")
    for name in ("x", "x.gguf", str(path)):
        answer = client.completions.create(model=name, prompt="hello", max_tokens=2)
        assert answer.model == "x" and answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="y.gguf", prompt="hello", max_tokens=2)
    message = missing.value.body["message"]
    assert message == "the model 'y.gguf' does not exist; this server serves 'x'"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("y")
    listing = json.dumps(client.models.list().model_dump())
    assert str(path.parent) not in listing and str(path.parent) not in message
