"""A server with speculative decoding: streamed and whole answers equal the offline engine's without
speculation, /metrics reports the acceptance, `pluginfer bench serve` prints it, and the engine-core process
(as `pluginfer serve` runs it) takes the config.

A tiny random model does not repeat its context, so the prompt-lookup proposer rarely drafts what it says;
here the proposer drafts the greedy continuation of one prompt (found offline without speculation), so that
most drafts are taken and, past its first 18 tokens, wrong ones are not; streaming then sees several
tokens a step."""

from __future__ import annotations

import json

import pytest

from pluginfer import LLM, SamplingParams
from pluginfer.cli import main
from pluginfer.server.core_client import CoreProcessClient
from pluginfer.server.launch import BackgroundServer
from pluginfer.speculative.ngram import NgramProposer
from tests.server.conftest import API_KEY, MODEL_NAME, http, make_client, server_config, start_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def expected(tiny_llama_checkpoint):
    with LLM(str(tiny_llama_checkpoint[0]), dtype="float32") as llm:
        return llm.generate(PROMPT, GREEDY)[0].outputs[0]


@pytest.fixture(scope="module")
def spec_server(tiny_llama_checkpoint, expected):
    known = expected.token_ids[:18] + [1] * 24  # token 1 is not what this model says next: those drafts fail
    lookup = NgramProposer.propose

    def propose(self, requests):
        drafts = lookup(self, requests)
        for index, request in enumerate(requests):
            if request.token_ids[:len(PROMPT)] == PROMPT:
                drafts[index] = known[len(request.token_ids) - len(PROMPT):][:request.max_tokens]
        return drafts

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NgramProposer, "propose", propose)
        config = server_config(tiny_llama_checkpoint[0], speculative_config=NGRAM, **{"server.api_keys": [API_KEY]})
        engine = start_engine(config)
        server = BackgroundServer(engine, config)
        yield server
        server.stop()
        engine.shutdown()


def test_served_answers_equal_decoding_without_speculation(spec_server, expected) -> None:
    with make_client(spec_server, strict=False) as client:
        whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True}, logprobs=1)
        chunks = [chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if chunk.choices]
    assert whole.choices[0].text == "".join(chunks) == expected.text
    assert len(chunks) < 24  # steps that took drafts streamed several tokens at once
    assert len(whole.choices[0].logprobs.tokens) == 24
    status, _, body = http(spec_server, "GET", "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    metrics = dict(line.rsplit(" ", 1) for line in body.decode().splitlines() if line.startswith("pluginfer_spec"))
    assert status == 200 and float(metrics["pluginfer_spec_decode_num_accepted_tokens_total"]) > 15
    assert 0 < float(metrics["pluginfer_spec_decode_acceptance_rate"]) < 1
    assert float(metrics["pluginfer_spec_decode_mean_accepted_length"]) > 2


def test_bench_serve_reports_the_acceptance(spec_server, tmp_path, capsys) -> None:
    """Random prompts of 200 tokens: the lookup finds earlier occurrences of single tokens and drafts."""
    out = tmp_path / "bench.json"
    status = main(["bench", "serve", "--base-url", spec_server.url, "--api-key", API_KEY, "--json", str(out),
                   "--concurrency", "2", "--input-len", "200", "--output-len", "16", "--num-prompts", "4"])
    figures = json.loads(out.read_text())
    assert status == 0 and 0 <= figures["spec_acceptance_rate"] <= 1 and figures["spec_mean_accepted_length"] >= 1
    assert "Draft acceptance rate" in capsys.readouterr().out


def test_the_engine_core_process_takes_the_speculative_config(tiny_llama_checkpoint, expected) -> None:
    config = server_config(tiny_llama_checkpoint[0], speculative_config=NGRAM)
    engine = CoreProcessClient(config).start()
    server = BackgroundServer(engine, config)
    try:
        with make_client(server, strict=False) as client:
            answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert answer.choices[0].text == expected.text
        assert engine.stats.spec_drafts > 0
    finally:
        server.stop()
        engine.shutdown()
