"""The web chat page's markdown renderer: hostile text rendered from escaped text in the page, a streamed answer's
markdown through the page, an error event mid-stream, and a code block's copy button (headless Chromium; the
fixtures are conftest.py's)."""

from __future__ import annotations

import json
import re

import pytest

from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import MODEL_NAME
from tests.server.web_chat.page import finished, send

sync_api = pytest.importorskip("playwright.sync_api")

HOSTILE = ("**bold** and *italic* and `<b>code</b>`\n"
           "<img src=x onerror=\"window.owned=1\"> <script>window.owned=2</script>\n"
           "[good](https://example.org/?a=1&b=2) [bad](javascript:window.owned=3) [data](data:text/html,x)\n"
           "- one\n- **two**\n\n1. first\n2. second\n\n"
           "```python\nprint(\"<script>\")\n```")


def test_markdown_is_rendered_from_escaped_text(page: object, open_server: BackgroundServer) -> None:
    page.goto(open_server.url + "/")
    html = page.evaluate("text => renderMarkdown(text)", HOSTILE)
    assert "<strong>bold</strong>" in html and "<em>italic</em>" in html
    assert "<code>&lt;b&gt;code&lt;/b&gt;</code>" in html
    assert "&lt;img src=x onerror=&quot;window.owned=1&quot;&gt;" in html and "<img" not in html
    assert "&lt;script&gt;" in html and "<script" not in html
    assert '<a href="https://example.org/?a=1&amp;b=2" target="_blank" rel="noopener noreferrer">good</a>' in html
    assert "javascript:" not in re.sub(r"\[bad\]\(javascript:[^)]*\)", "", html)  # left as text, not a link
    assert html.count("<a ") == 1
    assert "<ul><li>one</li><li><strong>two</strong></li></ul>" in html
    assert "<ol><li>first</li><li>second</li></ol>" in html
    assert '<pre><code class="language-python">print(&quot;&lt;script&gt;&quot;)</code></pre>' in html
    assert page.evaluate("renderMarkdown('```\\nstill streaming <x>')") == "<pre><code>still streaming &lt;x&gt;</code></pre>"


def test_markdown_of_a_streamed_answer_through_the_page(page: object, open_server: BackgroundServer) -> None:
    """A canned stream in the server's shape (the tiny model writes no markdown): the page parses the events,
    folds the reasoning away, renders the content's markdown and runs none of its HTML."""
    pieces = [{"role": "assistant", "content": ""}, {"reasoning_content": "Let me think <b>hard</b>."},
              *({"content": piece} for piece in re.findall(r".{1,7}", HOSTILE, re.S))]
    events = [{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL_NAME,
               "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in pieces]
    events[-1]["choices"][0]["finish_reason"] = "stop"
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    page.goto(open_server.url + "/")
    send(page, "Show me markdown")
    message = finished(page)
    content = message.locator(".content")
    sync_api.expect(content.locator("strong").first).to_have_text("bold")
    sync_api.expect(content.locator("pre code")).to_have_text('print("<script>")')
    assert content.locator("img, script").count() == 0
    assert content.locator("a").count() == 1 and content.locator("a").get_attribute("href").startswith("https://")
    assert "<img src=x" in content.inner_text()
    assert message.locator(".reasoning-text").text_content() == "Let me think <b>hard</b>."
    assert message.locator(".reasoning-text b").count() == 0
    assert page.evaluate("window.owned") is None


def test_an_error_event_mid_stream_is_shown(page: object, open_server: BackgroundServer) -> None:
    """The server's error event after a stream began (e.g. the engine died): the partial answer stays, marked."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL_NAME,
             "choices": [{"index": 0, "delta": {"content": "Partial **answer**"}, "finish_reason": None}]}
    error = {"error": {"message": "the engine process 42 died (SIGKILL)", "type": "server_error", "param": None,
                       "code": "engine_unavailable"}}
    body = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    page.goto(open_server.url + "/")
    send(page, "Hello")
    message = finished(page, state="failed")
    assert message.locator(".content").inner_html() == "<p>Partial <strong>answer</strong></p>"
    assert message.locator(".status").inner_text() == "failed: the engine process 42 died (SIGKILL)"
    sync_api.expect(page.locator("#error")).to_have_text("the engine process 42 died (SIGKILL)")
    sync_api.expect(page.locator("#send")).to_be_enabled()


def test_a_code_block_is_copied_by_its_button(page: object, open_server: BackgroundServer) -> None:
    """The Copy button puts the block's text, as written (markup characters, indentation, trailing spaces), on
    the clipboard; read back through Chromium's clipboard with the permission granted."""
    first = 'if a < b && c:\n    print("<b>&amp;</b>")  '
    answer = f"Two blocks:\n```python\n{first}\n```\nand\n```\nsecond `block`\n```"
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL_NAME,
             "choices": [{"index": 0, "delta": {"content": answer}, "finish_reason": "stop"}]}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"},
        body=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"))
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=open_server.url)
    page.goto(open_server.url + "/")
    send(page, "Show me code")
    message = finished(page)
    buttons = message.locator("pre button.copy")
    sync_api.expect(buttons).to_have_count(2)
    sync_api.expect(message.locator("pre code").first).to_have_text(first)  # the button is not part of the code
    buttons.first.click()
    sync_api.expect(buttons.first).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == first
    buttons.nth(1).click()
    sync_api.expect(buttons.nth(1)).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "second `block`"
    sync_api.expect(buttons.first).to_have_text("Copy")  # back to its label after a moment
    assert not page.errors, page.errors
