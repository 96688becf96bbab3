"""Helpers of the web chat page's tests: a server over the engine, and typing, sending and waiting in the page."""

from __future__ import annotations

from pathlib import Path

from pluginfer.engine.async_engine import AsyncEngine
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import server_config

MAX_TOKENS = 4000  # the stop test's answer: long enough to be stopped half way (the context is 4096)


def serve(engine: AsyncEngine, endless_llama: Path, **overrides: object) -> BackgroundServer:
    return BackgroundServer(engine, server_config(endless_llama, **{"cache.num_blocks": 1024, **overrides}))


def assistant_messages(page: object) -> object:
    return page.locator(".message.assistant")


def send(page: object, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def finished(page: object, index: int = 0, state: str = "done") -> object:
    from playwright.sync_api import expect

    message = assistant_messages(page).nth(index)
    expect(message).to_have_attribute("data-state", state, timeout=30_000)
    return message
