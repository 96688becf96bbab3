"""The web chat page at ``/`` (pluginfer/server/web/), driven in headless Chromium by playwright.

A real server over a tiny random llama answers: the test types a prompt, reads the streamed answer, stops a
long one, signs in with an API key (typed: the model label fills), reads a reasoning model's answer folded
away, and sees the first screen and the server's defaults in Settings. The markdown renderer and the code
block's copy button: test_markdown.py; the browser and the server: conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pluginfer.engine.async_engine import AsyncEngine
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import API_KEY, MODEL_NAME, http, wait_until_idle
from tests.server.web_chat.page import MAX_TOKENS, assistant_messages, finished, send, serve

sync_api = pytest.importorskip("playwright.sync_api")


# -- The page and its files ---------------------------------------------------------------------------------------


def test_page_and_files_are_served_with_a_strict_content_security_policy(open_server: BackgroundServer) -> None:
    status, headers, body = http(open_server, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert "connect-src 'self'" in headers["Content-Security-Policy"]
    html = body.decode()
    assert "<title>pluginfer chat</title>" in html
    for name in ("chat.js", "markdown.js", "chat.css"):
        assert f'"static/{name}"' in html
        status, headers, body = http(open_server, "GET", f"/static/{name}")
        assert status == 200 and body, name
    # Nothing is fetched from outside the server: no absolute URL in the page or its files.
    web = Path(__file__).resolve().parents[3] / "pluginfer" / "server" / "web"
    for path in web.iterdir():
        assert not re.search(r"(src|href)=\"(https?:)?//", path.read_text()), path.name
        assert not re.search(r"fetch\(\s*[\"'`]https?:", path.read_text()), path.name
    assert http(open_server, "GET", "/static/nothing.js")[0] == 404
    assert http(open_server, "GET", "/static/../app.py")[0] in (403, 404)


def test_a_typed_prompt_streams_an_answer(page: object, open_server: BackgroundServer) -> None:
    page.goto(open_server.url + "/")
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
    page.click("#toggle-settings")
    page.fill("#system-prompt", "You are terse.")
    page.fill("#temperature", "0")
    page.fill("#top-p", "0.9")
    page.fill("#max-tokens", "12")
    with page.expect_response("**/v1/chat/completions") as response_info:
        send(page, "Hello, who are you?")
    request = json.loads(response_info.value.request.post_data)
    assert request["stream"] is True and request["model"] == MODEL_NAME
    assert request["temperature"] == 0 and request["top_p"] == 0.9 and request["max_tokens"] == 12
    assert request["messages"] == [{"role": "system", "content": "You are terse."},
                                   {"role": "user", "content": "Hello, who are you?"}]
    message = finished(page)
    assert page.locator(".message.user .content").inner_text() == "Hello, who are you?"
    answer = message.locator(".content").inner_text().strip()
    assert answer, "the streamed answer is empty"
    assert "token limit" in message.locator(".status").inner_text()  # 12 tokens, never EOS

    # The same answer as the API gives for the same request (greedy), rendered: the page showed what was streamed.
    status, _, body = http(open_server, "POST", "/v1/chat/completions", body={**request, "stream": False})
    expected = json.loads(body)["choices"][0]["message"]["content"]
    assert status == 200
    assert message.locator(".content").inner_html() == page.evaluate("text => renderMarkdown(text)", expected)

    # A second turn carries the first answer, as streamed, in its history.
    with page.expect_response("**/v1/chat/completions") as response_info:
        send(page, "And then?")
    history = json.loads(response_info.value.request.post_data)["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user"]
    assert history[2] == {"role": "assistant", "content": expected}
    finished(page, 1)
    assert not page.errors, page.errors


def test_a_setting_the_server_refuses_shows_its_400(page: object, open_server: BackgroundServer) -> None:
    page.goto(open_server.url + "/")
    page.click("#toggle-settings")
    page.fill("#temperature", "-1")
    send(page, "Hello")
    sync_api.expect(page.locator("#error")).to_contain_text("400: ")
    sync_api.expect(page.locator("#error")).to_contain_text("temperature")
    sync_api.expect(page.locator("#prompt")).to_have_value("Hello")
    assert assistant_messages(page).count() == 0
    page.fill("#temperature", "")  # left empty: not sent, the server's default applies
    page.fill("#max-tokens", "4")
    with page.expect_response("**/v1/chat/completions") as response_info:
        send(page, "Hello")
    assert "temperature" not in json.loads(response_info.value.request.post_data)
    finished(page)
    sync_api.expect(page.locator("#error")).to_be_hidden()


def test_stop_aborts_the_stream_and_the_request(page: object, open_server: BackgroundServer,
                                               engine: AsyncEngine) -> None:
    page.goto(open_server.url + "/")
    page.click("#toggle-settings")
    page.fill("#max-tokens", str(MAX_TOKENS))
    send(page, "Tell me a long story.")
    message = assistant_messages(page).first
    sync_api.expect(page.locator("#stop")).to_be_enabled()
    sync_api.expect(message.locator(".content")).not_to_be_empty(timeout=30_000)
    page.click("#stop")
    finished(page, state="stopped")
    assert message.locator(".status").inner_text() == "stopped"
    sync_api.expect(page.locator("#stop")).to_be_disabled()
    sync_api.expect(page.locator("#send")).to_be_enabled()
    wait_until_idle(engine)  # the server aborted the request: no sequence left, every KV block free
    shown = message.locator(".content").inner_text()
    page.wait_for_timeout(300)
    assert message.locator(".content").inner_text() == shown  # nothing arrives after the stop
    _, _, metrics = http(open_server, "GET", "/metrics")
    generated = re.search(r"^pluginfer_generation_tokens_total (\S+)$", metrics.decode(), re.M)
    assert float(generated.group(1)) < MAX_TOKENS  # it did not run to its end
    assert re.search(r'pluginfer_requests_total\{route="/v1/chat/completions",status="499"\} [1-9]',
                     metrics.decode()), "the server did not see the client leave"
    assert not page.errors, page.errors


def test_api_key_is_asked_for_and_remembered_only_on_request(page: object, engine: AsyncEngine,
                                                            endless_llama: Path) -> None:
    server = serve(engine, endless_llama, **{"server.api_keys": [API_KEY]})
    try:
        page.goto(server.url + "/")  # the page itself needs no key
        error = page.locator("#error")
        sync_api.expect(error).to_contain_text("401: missing or invalid API key")
        sync_api.expect(page.locator("#api-key-box")).to_have_class(re.compile(r"\bneeded\b"))
        sync_api.expect(page.locator("#settings")).to_be_visible()

        send(page, "Hello")
        sync_api.expect(error).to_contain_text("401")
        sync_api.expect(page.locator("#prompt")).to_have_value("Hello")  # given back to send again
        assert assistant_messages(page).count() == 0

        page.fill("#api-key", "sk-wrong")
        page.press("#api-key", "Tab")  # a change event: the page tries the key
        sync_api.expect(error).to_contain_text("401")
        page.fill("#api-key", API_KEY)
        page.press("#api-key", "Tab")
        sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
        sync_api.expect(error).to_be_hidden()
        assert page.evaluate("localStorage.getItem('pluginfer.apiKey')") is None  # not asked to remember
        page.fill("#max-tokens", "8")
        send(page, "Hello")
        finished(page)
        assert assistant_messages(page).first.locator(".content").inner_text().strip()

        page.check("#remember-key")
        assert page.evaluate("localStorage.getItem('pluginfer.apiKey')") == API_KEY
        page.reload()
        sync_api.expect(page.locator("#api-key")).to_have_value(API_KEY)
        sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
        page.click("#toggle-settings")
        page.uncheck("#remember-key")
        assert page.evaluate("localStorage.getItem('pluginfer.apiKey')") is None
    finally:
        server.stop()


def test_reasoning_is_shown_collapsed(page: object, engine: AsyncEngine, endless_llama: Path) -> None:
    """deepseek_r1's parser: with no </think>, the whole answer is reasoning_content."""
    server = serve(engine, endless_llama, **{"server.reasoning_parser": "deepseek_r1"})
    try:
        page.goto(server.url + "/")
        page.click("#toggle-settings")
        page.fill("#max-tokens", "10")
        send(page, "Think about it.")
        message = finished(page)
        details = message.locator("details.reasoning")
        sync_api.expect(details).to_be_visible()
        assert details.get_attribute("open") is None  # collapsed
        sync_api.expect(message.locator(".reasoning-text")).to_be_hidden()
        assert re.fullmatch(r"Reasoning \(\d+ characters\)", details.locator("summary").inner_text())
        details.locator("summary").click()
        sync_api.expect(message.locator(".reasoning-text")).to_be_visible()
        assert message.locator(".reasoning-text").inner_text().strip()
    finally:
        server.stop()



def test_the_first_screen_says_what_to_do(page: object, open_server: BackgroundServer) -> None:
    page.goto(open_server.url + "/")
    empty = page.locator("#empty")
    sync_api.expect(empty).to_be_visible()
    sync_api.expect(page.locator("#empty-model")).to_have_text(MODEL_NAME)
    assert "press Enter to send" in empty.inner_text()
    sync_api.expect(page.locator("#empty-key")).to_be_hidden()
    page.click("#toggle-settings")
    page.fill("#temperature", "-1")  # refused: the conversation stays empty, so does the first screen
    send(page, "Hello")
    sync_api.expect(page.locator("#error")).to_contain_text("400: ")
    sync_api.expect(empty).to_be_visible()
    page.fill("#temperature", "")
    page.fill("#max-tokens", "4")
    send(page, "Hello")
    finished(page)
    sync_api.expect(empty).to_be_hidden()
    page.click("#new-chat")
    sync_api.expect(empty).to_be_visible()
    assert page.locator(".message").count() == 0
    assert not [e for e in page.errors if "400" not in e], page.errors  # the refused request's console line


def test_settings_show_the_servers_defaults(page: object, engine: AsyncEngine, endless_llama: Path) -> None:
    server = serve(engine, endless_llama, **{"sampling.temperature": 0.3, "sampling.max_tokens": 77})
    try:
        _, _, body = http(server, "GET", "/v1/models")
        defaults = json.loads(body)["data"][0]["sampling_defaults"]
        assert defaults["temperature"] == 0.3 and defaults["max_tokens"] == 77  # the deployment's values win
        page.goto(server.url + "/")
        page.click("#toggle-settings")
        for field, value in [("temperature", 0.3), ("top-p", defaults["top_p"]), ("max-tokens", 77)]:
            sync_api.expect(page.locator(f"#{field}")).to_have_attribute("placeholder", f"{value:g}")
        shown = page.locator("#defaults")
        for name, value in defaults.items():
            sync_api.expect(shown).to_contain_text(f"{name} {value:g}")
        with page.expect_response("**/v1/chat/completions") as response_info:
            send(page, "Hello")  # the fields stay empty: nothing is sent, the defaults shown apply
        request = json.loads(response_info.value.request.post_data)
        assert not {"temperature", "top_p", "max_tokens"} & request.keys()
        assert "token limit" in finished(page).locator(".status").inner_text()  # 77 tokens, never EOS
    finally:
        server.stop()


def test_a_typed_api_key_fills_the_model_label(page: object, engine: AsyncEngine, endless_llama: Path) -> None:
    """The key counts once typed, without leaving the field: the label, the first screen and the defaults."""
    server = serve(engine, endless_llama, **{"server.api_keys": [API_KEY]})
    try:
        page.goto(server.url + "/")
        sync_api.expect(page.locator("#error")).to_contain_text("401")
        sync_api.expect(page.locator("#empty-key")).to_be_visible()
        assert page.locator("#model").inner_text() == ""
        page.fill("#api-key", API_KEY)  # an input event only: the focus stays in the field
        sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
        assert page.evaluate("document.activeElement.id") == "api-key"
        sync_api.expect(page.locator("#empty-model")).to_have_text(MODEL_NAME)
        sync_api.expect(page.locator("#empty-key")).to_be_hidden()
        sync_api.expect(page.locator("#error")).to_be_hidden()
        _, _, body = http(server, "GET", "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        temperature = json.loads(body)["data"][0]["sampling_defaults"]["temperature"]
        sync_api.expect(page.locator("#temperature")).to_have_attribute("placeholder", f"{temperature:g}")
    finally:
        server.stop()

@pytest.mark.slow  # a pluginfer serve process: the engine core's start-up
def test_the_page_through_pluginfer_serve(browser: object, endless_llama: Path, tmp_path: Path) -> None:
    """As a user runs it: ``pluginfer serve`` (the engine in its own process) answers the page, and Stop reaches
    the engine process (no request left running)."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           "PLUGINFER_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env.pop("PLUGINFER_PLUGINS", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "pluginfer", "serve", "--model", str(endless_llama), "--dtype", "float32",
         "--num-blocks", "1024", "--block-size", "8", "--port", "0", "--served-model-name", MODEL_NAME],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = process.stdout.readline()
        match = re.search(r"on (http://\S+)", line)
        assert match, f"no startup line: {line!r}; stderr: {process.stderr.read() if process.poll() is not None else ''}"
        url = match.group(1)
        context = browser.new_context()
        page = context.new_page()
        page.goto(url + "/")
        sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
        page.click("#toggle-settings")
        page.fill("#max-tokens", "8")
        send(page, "Hello")
        assert finished(page).locator(".content").inner_text().strip()
        page.fill("#max-tokens", str(MAX_TOKENS))
        send(page, "A long one")
        message = assistant_messages(page).nth(1)
        sync_api.expect(message.locator(".content")).not_to_be_empty(timeout=30_000)
        page.click("#stop")
        finished(page, 1, state="stopped")
        context.close()
        deadline = time.monotonic() + 10
        while True:  # the engine process aborted it: nothing runs, the tokens stop short of MAX_TOKENS
            metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
            running = float(re.search(r"^pluginfer_num_requests_running (\S+)$", metrics, re.M).group(1))
            if running == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert running == 0, metrics
        generated = float(re.search(r"^pluginfer_generation_tokens_total (\S+)$", metrics, re.M).group(1))
        assert generated < 8 + MAX_TOKENS
    finally:
        process.terminate()
        process.communicate(timeout=60)
