"""The chat page with an image: picked or pasted, previewed, sent as an image_url part, shown in the user's
message; the served model (a tiny Qwen2-VL) answers it. Headless Chromium (the browser: conftest.py)."""

from __future__ import annotations

import io
import json

import pytest

from tests.models.test_qwen2_vl import image
from tests.server.test_images import vision_server  # noqa: F401  (fixture)

sync_api = pytest.importorskip("playwright.sync_api")


def png_bytes(seed: int) -> bytes:
    buffer = io.BytesIO()
    image(40, 60, seed).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_image_is_attached_sent_and_shown(browser, vision_server) -> None:  # noqa: F811 - the fixture
    server = vision_server[0]
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(server.url + "/")
        page.click("#toggle-settings")
        page.fill("#max-tokens", "3")
        page.set_input_files("#image-file", files=[{"name": "cat.png", "mimeType": "image/png",
                                                    "buffer": png_bytes(1)}])
        sync_api.expect(page.locator("#attachment")).to_be_visible()
        with page.expect_response("**/v1/chat/completions") as response_info:
            page.fill("#prompt", "what is it")
            page.press("#prompt", "Enter")
        sent = json.loads(response_info.value.request.post_data)["messages"][-1]["content"]
        assert sent[0] == {"type": "text", "text": "what is it"}
        assert sent[1]["image_url"]["url"].startswith("data:image/png;base64,")
        assert response_info.value.status == 200
        sync_api.expect(page.locator(".message.assistant").first).to_have_attribute("data-state", "done",
                                                                                    timeout=30_000)
        assert page.locator(".message.user img.sent-image").get_attribute("src") == sent[1]["image_url"]["url"]
        sync_api.expect(page.locator("#attachment")).to_be_hidden()  # sent: the next message goes without it

        # A pasted image is attached too.
        page.evaluate("""bytes => {
            const file = new File([new Uint8Array(bytes)], "pasted.png", { type: "image/png" });
            const data = new DataTransfer();
            data.items.add(file);
            document.getElementById("prompt").dispatchEvent(
                new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true }));
        }""", list(png_bytes(2)))
        sync_api.expect(page.locator("#attachment")).to_be_visible()
        page.click("#remove-image")
        sync_api.expect(page.locator("#attachment")).to_be_hidden()
        assert not errors, errors
    finally:
        context.close()
