"""Chat completions with image_url parts (base64 data URIs) on a tiny Qwen2-VL: through the official openai
client the answer is transformers' own; bad parts are 400s in OpenAI's shape naming the part."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from pluginfer.server.launch import BackgroundServer
from tests.models.qwen2_vl_checkpoint import hf_image_greedy, save_qwen2_vl
from tests.models.test_qwen2_vl import data_uri, image
from tests.server.conftest import API_KEY, MODEL_NAME, http, server_config, start_engine

TOKENS = 6


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    from transformers import AutoImageProcessor, AutoTokenizer

    path = tmp_path_factory.mktemp("qwen2_vl_server")
    model = save_qwen2_vl(path, tiny_tokenizer_dir)
    engine = start_engine(server_config(path))
    server = BackgroundServer(engine, server_config(path))
    yield server, model, AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    server.stop()
    engine.shutdown()


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_served_answer_is_transformers(vision_server) -> None:
    server, model, processor, tokenizer = vision_server
    img = image(80, 120, 7)
    messages = user({"type": "text", "text": "describe "}, {"type": "image_url", "image_url": {"url": data_uri(img)}})
    rendered = tokenizer.apply_chat_template(user({"type": "text", "text": "describe "}, {"type": "image"}),
                                             add_generation_prompt=True, tokenize=False)
    want = hf_image_greedy(model, processor, tokenizer.encode(rendered, add_special_tokens=False), [img], TOKENS)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=False)


@pytest.mark.parametrize("url, why", [
    ("data:image/png;base64,@@not base64@@", "not valid base64"),
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not an image"),
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
])
def test_bad_image_parts_are_400s(vision_server, url: str, why: str) -> None:
    server = vision_server[0]
    status, _, body = http(server, "POST", "/v1/chat/completions", {
        "model": MODEL_NAME, "max_tokens": 2,
        "messages": user({"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}})})
    error = json.loads(body)["error"]
    assert status == 400 and why in error["message"] and error["param"] == "messages[0].content[1]"


def test_too_many_images_is_a_400_and_the_server_keeps_serving(vision_server) -> None:
    server = vision_server[0]
    part = {"type": "image_url", "image_url": {"url": data_uri(image(30, 30, 1))}}
    status, _, body = http(server, "POST", "/v1/chat/completions", {
        "model": MODEL_NAME, "max_tokens": 2, "messages": user(*[part] * 17)})
    assert status == 400 and "more than the 16" in json.loads(body)["error"]["message"]
    status, _, _ = http(server, "POST", "/v1/chat/completions", {
        "model": MODEL_NAME, "max_tokens": 2, "messages": user({"type": "text", "text": "hi"}, part)})
    assert status == 200


def test_image_to_a_text_only_model_is_a_400(tiny_llama_checkpoint) -> None:
    config = server_config(tiny_llama_checkpoint[0])
    engine = start_engine(config)
    server = BackgroundServer(engine, config)
    try:
        part = {"type": "image_url", "image_url": {"url": data_uri(image(30, 30, 1))}}
        status, _, body = http(server, "POST", "/v1/chat/completions", {
            "model": MODEL_NAME, "max_tokens": 2, "messages": user({"type": "text", "text": "hi"}, part)})
        error = json.loads(body)["error"]
        assert status == 400 and "takes text only" in error["message"]
        assert error["param"] == "messages[0].content[1]" and error["type"] == "invalid_request_error"
        status, _, _ = http(server, "POST", "/v1/chat/completions", {
            "model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200
    finally:
        server.stop()
        engine.shutdown()
