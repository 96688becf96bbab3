"""LoRA adapters served as vLLM serves them, through the engine core process `pluginfer serve` runs: `model` names
the adapter (answers as transformers + peft's), /v1/models lists adapters with their parent, adapters load and
unload at run time behind lora.allow_runtime_lora_updating, and bad names and adapters are 4xx naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoints import hf_greedy, random_prompts, save_hf_model
from tests.conftest import TINY_LLAMA
from tests.engine.test_lora import ADAPTERS, copy_adapter, save_adapter
from tests.server.conftest import MODEL_NAME, http, server_config

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    from pluginfer.server.core_client import CoreProcessClient
    from pluginfer.server.launch import BackgroundServer

    root = tmp_path_factory.mktemp("lora_serving")
    base = save_hf_model("LlamaForCausalLM", TINY_LLAMA, root / "base", tiny_tokenizer_dir)
    models = {name: save_adapter(base, root / name, seed, **ADAPTERS[name])
              for seed, name in enumerate(["all", "attn"], start=1)}
    prompt = random_prompts(base.config.vocab_size, [6], seed=4)[0]
    expected = {None: hf_greedy(base, prompt, MAX_TOKENS),
                **{name: hf_greedy(model, prompt, MAX_TOKENS) for name, model in models.items()}}
    overrides = {"lora.enable_lora": True, "lora.max_loras": 2, "lora.max_lora_rank": 8,
                 "lora.lora_modules": [f"one={root / 'all'}"], "lora.allow_runtime_lora_updating": True}
    config = server_config(root / "base", **overrides)
    engine = CoreProcessClient(config).start()
    server = BackgroundServer(engine, config)
    locked = BackgroundServer(engine, server_config(root / "base", **{**overrides,
                                                                      "lora.allow_runtime_lora_updating": False}))
    yield server, locked, root, prompt, expected
    locked.stop()
    server.stop()
    engine.shutdown()


def complete(server, model: str, prompt: list[int]) -> tuple[int, dict]:
    status, _, body = http(server, "POST", "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    return status, json.loads(body)


def test_adapters_answer_as_peft_and_are_listed(served) -> None:
    server, _, root, prompt, expected = served
    status, _, body = http(server, "GET", "/v1/models")
    cards = {card["id"]: card for card in json.loads(body)["data"]}
    assert set(cards) == {MODEL_NAME, "one"} and cards["one"]["parent"] == MODEL_NAME
    assert cards["one"]["root"] == "one"  # no local path on the API
    for model, name in [(MODEL_NAME, None), ("one", "all")]:
        status, answer = complete(server, model, prompt)
        assert status == 200 and answer["model"] == model, answer
        assert answer["choices"][0]["text"] == _decode(root, expected[name]), model


def test_chat_with_an_adapter_answers_as_peft(served) -> None:
    """The chat template's prompt (as /tokenize renders it) continued by peft's model, streamed or not."""
    server, _, root, _, _ = served
    messages = [{"role": "user", "content": "hello there"}]
    _, _, body = http(server, "POST", "/tokenize", {"messages": messages, "add_generation_prompt": True})
    prompt = json.loads(body)["tokens"]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(root / "base"))
    want = _decode(root, hf_greedy(PeftModel.from_pretrained(base, str(root / "attn")).eval(), prompt, MAX_TOKENS))
    http(server, "POST", "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(root / "attn")})
    try:
        request = {"model": "chat", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                   "ignore_eos": True}
        status, _, body = http(server, "POST", "/v1/chat/completions", request)
        answer = json.loads(body)
        assert status == 200 and answer["choices"][0]["message"]["content"] == want and answer["model"] == "chat"
        status, _, body = http(server, "POST", "/v1/chat/completions", {**request, "stream": True})
        events = [json.loads(line[6:]) for line in body.decode().splitlines()
                  if line.startswith("data: {")]
        assert status == 200 and "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                                         if e["choices"]) == want
    finally:
        http(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"})


def test_responses_and_messages_with_an_adapter_answer_as_its_chat(served) -> None:
    """/v1/responses and /v1/messages naming an adapter: the text its chat completion (peft's, above) answers,
    not the base's, and the adapter's name in ``model``."""
    server, _, _, _, _ = served
    texts = {}
    for model in ("one", MODEL_NAME):
        _, _, body = http(server, "POST", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": MAX_TOKENS,
            "temperature": 0})
        texts[model] = json.loads(body)["choices"][0]["message"]["content"]
        status, _, body = http(server, "POST", "/v1/responses", {
            "model": model, "input": "hello there", "max_output_tokens": MAX_TOKENS, "temperature": 0})
        answer = json.loads(body)
        assert status == 200 and answer["model"] == model, answer
        assert answer["output"][-1]["content"][0]["text"] == texts[model]
        status, _, body = http(server, "POST", "/v1/messages", {
            "model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": MAX_TOKENS,
            "temperature": 0})
        answer = json.loads(body)
        assert status == 200 and answer["model"] == model, answer
        assert answer["content"][0]["text"] == texts[model]
    assert texts["one"] != texts[MODEL_NAME]


def test_beam_search_with_an_adapter_answers_as_peft(served) -> None:
    """use_beam_search on /v1/completions naming an adapter: the n beams of peft's ``generate(num_beams=...)``,
    best first, and the adapter's name in ``model``; on chat too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pluginfer.engine.beam_search import BeamSearchParams
    from tests.checkpoints import hf_beams

    server, _, root, prompt, _ = served
    base = AutoModelForCausalLM.from_pretrained(str(root / "base"))
    model = PeftModel.from_pretrained(base, str(root / "all")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(root / "base"))
    eos = base.generation_config.eos_token_id
    beams, _ = hf_beams(model, prompt, BeamSearchParams(beam_width=3, max_tokens=6), eos)
    with model.disable_adapter():
        assert hf_beams(model, prompt, BeamSearchParams(beam_width=3, max_tokens=6), eos)[0] != beams
    status, _, body = http(server, "POST", "/v1/completions", {
        "model": "one", "prompt": prompt, "max_tokens": 6, "n": 3, "use_beam_search": True, "temperature": 0})
    answer = json.loads(body)
    assert status == 200 and answer["model"] == "one", answer
    assert [c["text"] for c in answer["choices"]] == [tokenizer.decode(b, skip_special_tokens=True) for b in beams]
    status, _, body = http(server, "POST", "/v1/chat/completions", {
        "model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
        "use_beam_search": True})
    answer = json.loads(body)
    assert status == 200 and answer["model"] == "one" and len(answer["choices"]) == 2, answer


def test_rerank_and_score_with_an_adapter(encoder_checkpoints: dict, tmp_path: Path) -> None:
    """/v1/rerank and /v1/score naming an adapter on a cross-encoder, through the engine core process: the scores
    of sentence-transformers with the adapter loaded, the adapter's name in ``model``; the base's name answers as
    the base."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification

    from pluginfer.server.core_client import CoreProcessClient
    from pluginfer.server.launch import BackgroundServer

    cross = encoder_checkpoints["bert_cross"]
    save_adapter(AutoModelForSequenceClassification.from_pretrained(str(cross)), tmp_path / "cross", 5, r=4,
                 lora_alpha=8, target_modules=["query", "value", "intermediate.dense"])
    query, documents = "the quick brown fox", ["the sea is calm", "jumps over the lazy dog"]
    oracle = CrossEncoder(str(cross), device="cpu")
    plain = oracle.predict([(query, d) for d in documents])
    oracle.load_adapter(str(tmp_path / "cross"))
    want = oracle.predict([(query, d) for d in documents])
    config = server_config(cross, **{"lora.enable_lora": True, "lora.max_lora_rank": 4,
                                     "lora.lora_modules": [f"tuned={tmp_path / 'cross'}"]})
    engine = CoreProcessClient(config).start()
    server = BackgroundServer(engine, config)
    try:
        for model, scores in (("tuned", want), (MODEL_NAME, plain)):
            status, _, body = http(server, "POST", "/v1/rerank", {"model": model, "query": query,
                                                                 "documents": documents})
            answer = json.loads(body)
            assert status == 200 and answer["model"] == model, answer
            assert {r["index"]: r["relevance_score"] for r in answer["results"]} == \
                pytest.approx(dict(enumerate(scores.tolist())), abs=1e-5)
            status, _, body = http(server, "POST", "/v1/score", {"model": model, "text_1": query,
                                                                "text_2": documents})
            answer = json.loads(body)
            assert status == 200 and answer["model"] == model, answer
            assert [d["score"] for d in answer["data"]] == pytest.approx(scores.tolist(), abs=1e-5)
    finally:
        server.stop()
        engine.shutdown()


def _decode(root: Path, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root / "base")).decode(tokens)


def test_runtime_load_and_unload(served, tmp_path: Path) -> None:
    server, locked, root, prompt, expected = served
    status, _, body = http(locked, "POST", "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": "x"})
    assert status == 404 and "--allow-runtime-lora-updating" in json.loads(body)["error"]["message"]
    status, _, body = http(server, "POST", "/v1/load_lora_adapter",
                           {"lora_name": "two", "lora_path": str(root / "attn")})
    assert status == 200, body
    status, answer = complete(server, "two", prompt)
    assert status == 200 and answer["choices"][0]["text"] == _decode(root, expected["attn"])
    status, _, body = http(server, "POST", "/v1/load_lora_adapter",
                           {"lora_name": "two", "lora_path": str(root / "attn")})
    assert status == 400 and "'two' has already been loaded" in json.loads(body)["error"]["message"]
    status, _, body = http(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "two"})
    assert status == 200, body
    status, answer = complete(server, "two", prompt)
    assert status == 404 and answer["error"]["code"] == "model_not_found" and "'two'" in answer["error"]["message"]
    status, _, body = http(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "two"})
    assert status == 404


def test_bad_adapters_and_names_are_4xx_naming_them(served, tmp_path: Path) -> None:
    server, _, root, prompt, expected = served
    status, answer = complete(server, "nope", prompt)
    assert status == 404 and "'nope'" in answer["error"]["message"] and answer["error"]["param"] == "model"
    status, _, body = http(server, "POST", "/v1/load_lora_adapter",
                           {"lora_name": "gone", "lora_path": str(tmp_path / "missing")})
    assert status == 400 and "'gone'" in json.loads(body)["error"]["message"]
    big = copy_adapter(root / "all", tmp_path / "big", r=16)
    from tests.engine.test_lora import _scale_rank

    _scale_rank(big, 16)
    status, _, body = http(server, "POST", "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert status == 400 and "above max_lora_rank 8" in json.loads(body)["error"]["message"]
    status, _, body = http(server, "POST", "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400
    # nothing else was disturbed
    status, answer = complete(server, "one", prompt)
    assert status == 200 and answer["choices"][0]["text"] == _decode(root, expected["all"])
