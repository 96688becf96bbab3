"""Take the chat page's screenshots in docs/images/ (headless Chromium through playwright).

    python docs/images/make_chat_screenshots.py

chat-demo.png: the page over ``pluginfer serve --model demo`` (random weights: the answer is noise), with the
settings open. chat-markdown.png: the same page rendering a canned stream (written below, as
tests/server/web_chat/ does) with reasoning and markdown, since the demo model writes neither.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

from pluginfer.core.config import build_config
from pluginfer.demo.model import with_demo_model
from pluginfer.engine.async_engine import AsyncEngine
from pluginfer.engine.engine import LLMEngine
from pluginfer.server.launch import BackgroundServer

HERE = Path(__file__).resolve().parent
REASONING = ("The user asks how to serve a model. pluginfer serve takes --model and --port; "
             "the chat page is at / on the same port.")
ANSWER = """Start the server with **`pluginfer serve`**:

```bash
pluginfer serve --model ./my-checkpoint --port 8000
```

Then:
1. open `http://127.0.0.1:8000/` for this page, or
2. point any *OpenAI client* at `http://127.0.0.1:8000/v1`.

See [the server docs](https://example.org/docs/server.md) for API keys and sampling defaults."""


def canned_stream() -> str:
    pieces = [{"role": "assistant", "content": ""},
              *({"reasoning_content": piece} for piece in re.findall(r".{1,12}", REASONING, re.S)),
              *({"content": piece} for piece in re.findall(r".{1,12}", ANSWER, re.S))]
    events = [{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "demo",
               "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in pieces]
    events[-1]["choices"][0]["finish_reason"] = "stop"
    return "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"


def main() -> int:
    config = with_demo_model(build_config(model="demo", **{"server.port": 0}))
    engine = AsyncEngine(LLMEngine(config)).start()
    server = BackgroundServer(engine, config)
    executable = shutil.which("chromium")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=executable, headless=True)
            page = browser.new_page(viewport={"width": 1200, "height": 720})
            page.goto(server.url + "/")
            expect(page.locator("#model")).to_contain_text("demo")
            page.click("#toggle-settings")
            page.fill("#system-prompt", "You are a helpful assistant.")
            page.fill("#temperature", "0.7")
            page.fill("#max-tokens", "60")
            page.fill("#prompt", "Write a haiku about paged attention.")
            page.press("#prompt", "Enter")
            expect(page.locator(".message.assistant").first).to_have_attribute("data-state", "done", timeout=60_000)
            page.fill("#prompt", "And one about continuous batching?")
            page.screenshot(path=str(HERE / "chat-demo.png"))

            page = browser.new_page(viewport={"width": 1200, "height": 720})
            page.route("**/v1/chat/completions", lambda route: route.fulfill(
                status=200, headers={"Content-Type": "text/event-stream"}, body=canned_stream()))
            page.goto(server.url + "/")
            page.fill("#prompt", "How do I serve a model and chat with it?")
            page.press("#prompt", "Enter")
            message = page.locator(".message.assistant").first
            expect(message).to_have_attribute("data-state", "done")
            message.locator("details.reasoning summary").click()
            page.screenshot(path=str(HERE / "chat-markdown.png"))
            browser.close()
    finally:
        server.stop()
        engine.shutdown()
    print(f"wrote {HERE / 'chat-demo.png'} and {HERE / 'chat-markdown.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
