"""A model's generation_config.json sampling defaults: a request's value wins, then the deployment's ``sampling:``,
then the model's, then the built-in ones (as vLLM), offline and served; ``/v1/models`` shows what applies."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import openai
import pytest

from pluginfer import LLM, SamplingParams
from pluginfer.core.config import SamplingDefaults
from pluginfer.engine.generation_config import model_sampling_defaults
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import MODEL_NAME, server_config, start_engine

# The model says greedy, and a top_p/top_k a request that samples (temperature > 0) inherits.
MODEL_SAYS = {"temperature": 0.0, "top_p": 0.95, "top_k": 20}
SEEDS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("generation_defaults") / "model"
    shutil.copytree(tiny_llama_checkpoint[0], path)
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, **MODEL_SAYS}))
    return path


def test_the_model_fields_are_read_and_a_bad_one_is_left_out(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": "high", "repetition_penalty": None,
         "max_new_tokens": 50, "eos_token_id": 2}))
    with caplog.at_level(logging.WARNING):
        found = model_sampling_defaults(tmp_path)
    assert found == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert "min_p='high' is not a valid default" in caplog.text
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_sampling_defaults(gguf) == {}  # a GGUF file has no generation_config.json
    defaults = SamplingDefaults(temperature=0.3).over(found)  # the deployment's wins, the built-in fills the rest
    assert defaults.model_dump() == {"temperature": 0.3, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                     "repetition_penalty": 1.0, "max_tokens": 256}


def test_offline_generate_without_params_takes_the_models_defaults(checkpoint):
    llm = LLM(model=str(checkpoint), dtype="float32", num_blocks=64, block_size=8)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.0, 0.95, 20)
        prompts = ["hello world", "the cat sat on the mat"]
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts)] == [o.outputs[0].token_ids for o in greedy]
    finally:
        llm.close()
    deployed = LLM(model=str(checkpoint), dtype="float32", num_blocks=64, block_size=8, default_temperature=0.7)
    try:
        defaults = deployed.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.95, 20)
    finally:
        deployed.close()


@pytest.fixture(scope="module")
def servers(checkpoint):
    """One engine; a server that leaves sampling to the model, one whose deployment sets a temperature."""
    engine = start_engine(server_config(checkpoint))
    plain = BackgroundServer(engine, server_config(checkpoint))
    deployed = BackgroundServer(engine, server_config(checkpoint, **{"sampling.temperature": 1.0}))
    yield plain, deployed
    plain.stop()
    deployed.stop()
    engine.shutdown()


def _texts(server: BackgroundServer, **fields: object) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    return [client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=8, seed=seed,
                                      extra_body={"ignore_eos": True}, **fields).choices[0].text
            for seed in SEEDS]


def test_the_server_applies_and_shows_the_models_defaults_under_the_deployments_and_requests(servers):
    plain, deployed = servers
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused")
    [card] = [model.model_dump() for model in client.models.list().data]
    assert card["sampling_defaults"] == {"temperature": 0.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                         "repetition_penalty": 1.0, "max_tokens": 256}
    deployed_card = openai.OpenAI(base_url=deployed.url + "/v1", api_key="unused").models.retrieve(MODEL_NAME)
    assert deployed_card.model_dump()["sampling_defaults"]["temperature"] == 1.0

    greedy = _texts(plain, temperature=0.0)
    assert _texts(plain) == greedy  # the model says greedy: every seed gives the greedy answer
    assert len(set(_texts(deployed))) > 1  # the deployment's temperature wins over the model's
    assert len(set(_texts(plain, temperature=1.0))) > 1  # and a request's over both
