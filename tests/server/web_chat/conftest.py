"""The web chat page's fixtures: headless Chromium (playwright), a tiny llama that never stops on its own, a server
over it and a fresh page per test.

The browser: $PLUGINFER_CHROMIUM, else Debian's ``chromium`` on PATH, else playwright's own (``playwright
install chromium``). Without any the tests skip, which tests/native_usage.py turns into a failure under CI
(.ci/run installs Debian's chromium).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pluginfer.engine.async_engine import AsyncEngine
from pluginfer.server.launch import BackgroundServer
from tests.checkpoints import save_hf_model
from tests.conftest import TINY_LLAMA
from tests.native_usage import NO_BROWSER  # a skip the conftest fails under CI
from tests.server.conftest import server_config, start_engine, wait_until_idle
from tests.server.web_chat.page import serve


def chromium_executable(playwright: object) -> str | None:
    """A Chromium to drive: $PLUGINFER_CHROMIUM, Debian's, or the one ``playwright install`` fetched."""
    named = os.environ.get("PLUGINFER_CHROMIUM")
    if named:
        return named
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    own = playwright.chromium.executable_path
    return own if own and Path(own).is_file() else None


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        executable = chromium_executable(playwright)
        if executable is None:
            pytest.skip(f"{NO_BROWSER}: install Debian's chromium (apt-get install chromium) or run "
                        f"`playwright install chromium`, or set PLUGINFER_CHROMIUM")
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def endless_llama(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """The tiny llama with a 4096-token context whose LM head never picks a special token (EOS included):
    their rows are zero (logit 0) and the others' are scaled up, so every answer runs to max_tokens. 12 layers:
    a long answer runs for seconds, longer than a loaded machine's browser takes to see it start (with 2 layers
    the stop test's whole answer once came and went in 1 s before the page looked)."""
    out = tmp_path_factory.mktemp("endless_llama")
    save_hf_model("LlamaForCausalLM", {**TINY_LLAMA, "max_position_embeddings": 4096, "num_hidden_layers": 12}, out,
                  tiny_tokenizer_dir)
    from transformers import AutoTokenizer

    special = AutoTokenizer.from_pretrained(str(out)).all_special_ids
    weights = load_file(out / "model.safetensors")
    head = weights["lm_head.weight"] * 40
    head[special] = 0
    weights["lm_head.weight"] = head.contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def engine(endless_llama: Path) -> Iterator[AsyncEngine]:
    engine = start_engine(server_config(endless_llama, **{"cache.num_blocks": 1024}))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def open_server(engine: AsyncEngine, endless_llama: Path) -> Iterator[BackgroundServer]:
    server = serve(engine, endless_llama)
    yield server
    server.stop()


@pytest.fixture
def page(browser: object, engine: AsyncEngine) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.errors = errors
    yield page
    context.close()
    wait_until_idle(engine)
