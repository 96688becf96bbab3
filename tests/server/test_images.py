"""Chat completions with image_url parts (base64 data URIs) on a tiny Qwen2-VL: through the official openai
client the answer is transformers' own; bad parts are 400s in OpenAI's shape naming the part."""

from __future__ import annotations

import io
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
    yield server, model, AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path), engine, path
    server.stop()
    engine.shutdown()


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_served_answer_is_transformers(vision_server) -> None:
    server, model, processor, tokenizer, _, _ = vision_server
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
    ("https://example.com/cat.png", "server.allowed_media_domains"),
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


@pytest.fixture
def image_host():
    """A local HTTP server: /cat.png an image, /slow an answer after 3 s, anything else a 404."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    png = io.BytesIO()
    image(40, 40, 5).save(png, format="PNG")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/slow":
                time.sleep(3)
            if self.path in ("/cat.png", "/slow"):
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(png.getvalue())))
                    self.end_headers()
                    self.wfile.write(png.getvalue())
                except (BrokenPipeError, ConnectionResetError):  # /slow: the server gave up on it
                    pass
            else:
                self.send_error(404)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_remote_urls_of_allowed_hosts_are_fetched(vision_server, image_host: str) -> None:
    _, _, _, _, engine, path = vision_server
    config = server_config(path, **{"server.allowed_media_domains": ["127.0.0.1"], "server.media_fetch_timeout_s": 1})
    server = BackgroundServer(engine, config)
    try:
        def ask(url: str) -> tuple[int, dict]:
            status, _, body = http(server, "POST", "/v1/chat/completions", {
                "model": MODEL_NAME, "max_tokens": 2, "temperature": 0,
                "messages": user({"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}})})
            return status, json.loads(body)

        fetched, _ = ask(image_host + "/cat.png")
        with_data_uri = http(server, "POST", "/v1/chat/completions", {
            "model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "messages": user(
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": data_uri(image(40, 40, 5))}})})
        assert fetched == 200 and with_data_uri[0] == 200
        assert ask(image_host + "/cat.png")[1]["choices"][0]["message"] == \
            json.loads(with_data_uri[2])["choices"][0]["message"]
        for url, why in [(image_host + "/missing.png", "HTTP 404"), (image_host + "/slow", "failed"),
                         (image_host.replace("127.0.0.1", "localhost") + "/cat.png", "'localhost' is not one")]:
            status, body = ask(url)
            assert status == 400 and why in body["error"]["message"], body
            assert body["error"]["param"] == "messages[0].content[1]"
    finally:
        server.stop()


def test_file_urls_are_read_only_under_the_allowed_directory(vision_server, tmp_path: Path) -> None:
    _, _, _, _, engine, path = vision_server
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    image(40, 40, 5).save(allowed / "cat.png")
    image(40, 40, 5).save(outside / "cat.png")
    (allowed / "escape.png").symlink_to(outside / "cat.png")
    (allowed / "notes.txt").write_text("not an image")
    server = BackgroundServer(engine, server_config(path, **{"server.allowed_local_media_path": str(allowed)}))
    plain = BackgroundServer(engine, server_config(path))
    try:
        def ask(on: BackgroundServer, url: str) -> tuple[int, dict]:
            status, _, body = http(on, "POST", "/v1/chat/completions", {
                "model": MODEL_NAME, "max_tokens": 2, "temperature": 0,
                "messages": user({"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}})})
            return status, json.loads(body)

        status, read = ask(server, (allowed / "cat.png").as_uri())
        assert status == 200
        assert read["choices"][0]["message"] == ask(server, data_uri(image(40, 40, 5)))[1]["choices"][0]["message"]
        for on, url, why in [
            (server, (outside / "cat.png").as_uri(), "outside server.allowed_local_media_path"),
            (server, f"file://{allowed}/../private/cat.png", "outside server.allowed_local_media_path"),
            (server, (allowed / "escape.png").as_uri(), "outside server.allowed_local_media_path"),
            (server, (allowed / "missing.png").as_uri(), "cannot be read"),
            (server, (allowed / "notes.txt").as_uri(), "not an image"),
            (server, f"file://example.com{allowed}/cat.png", "not of 'example.com'"),
            (plain, (allowed / "cat.png").as_uri(), "which is not set"),
        ]:
            status, body = ask(on, url)
            assert status == 400 and why in body["error"]["message"], (url, body)
            assert body["error"]["param"] == "messages[0].content[1]"
    finally:
        server.stop()
        plain.stop()


def test_through_the_engine_core_process(vision_server) -> None:
    """As ``pluginfer serve`` runs it: the request's images cross to the engine core process."""
    from pluginfer.server.core_client import CoreProcessClient

    server, model, processor, tokenizer, _, path = vision_server
    img = image(80, 120, 8)
    messages = user({"type": "image_url", "image_url": {"url": data_uri(img)}}, {"type": "text", "text": "and?"})
    rendered = tokenizer.apply_chat_template(user({"type": "image"}, {"type": "text", "text": "and?"}),
                                             add_generation_prompt=True, tokenize=False)
    want = hf_image_greedy(model, processor, tokenizer.encode(rendered, add_special_tokens=False), [img], TOKENS)
    config = server_config(path)
    engine = CoreProcessClient(config).start()
    core_server = BackgroundServer(engine, config)
    try:
        client = openai.OpenAI(base_url=core_server.url + "/v1", api_key=API_KEY)
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True, "skip_special_tokens": False})
        assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=False)
    finally:
        core_server.stop()
        engine.shutdown()
