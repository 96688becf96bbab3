"""Security settings of the server: CORS off unless configured, and broken plugins that a served model does
not use never take the server down. API keys: tests/server/test_errors.py::test_api_keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.core.fake_dists import make_dist
from tests.server.conftest import API_KEY, MODEL_NAME, http

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_is_off_by_default(server):
    status, headers, _ = http(server, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and not any(name.lower().startswith("access-control") for name in headers)
    status, headers, _ = http(server, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert status == 405 and "Access-Control-Allow-Origin" not in headers


def test_allowed_origins_get_cors_headers_and_a_preflight_without_a_key(make_server):
    cors = make_server(**{"server.allowed_origins": [ORIGIN], "server.api_keys": [API_KEY]})
    status, headers, raw = http(cors, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert status == 204, raw
    assert headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    keyed = {"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"}
    status, headers, _ = http(cors, "GET", "/v1/models", headers=keyed)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN and headers["Vary"] == "Origin"
    status, headers, _ = http(cors, "GET", "/v1/models", headers={"Origin": ORIGIN})  # still needs the key
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ORIGIN  # the browser may read the 401
    status, headers, _ = http(cors, "OPTIONS", "/v1/chat/completions", headers={**PREFLIGHT,
                                                                               "Origin": "https://evil.example"})
    assert status != 204 and "Access-Control-Allow-Origin" not in headers
    any_origin = make_server(**{"server.allowed_origins": ["*"]})
    status, headers, _ = http(any_origin, "GET", "/v1/models", headers={"Origin": "https://elsewhere.example"})
    assert headers["Access-Control-Allow-Origin"] == "https://elsewhere.example"


BROKEN_PLUGINS = {
    # distribution: (modules, entry points)
    "broken-import": ({"brk_import": "raise RuntimeError('boom at import')"}, {"brkimport": "brk_import"}),
    "exits-at-import": ({"brk_exit": "import sys\nsys.exit(3)"}, {"brkexit": "brk_exit"}),
    "broken-hook": ({"brk_hook": textwrap.dedent("""
        from pluginfer.core.hookspecs import hookimpl

        @hookimpl
        def pluginfer_models():
            raise ValueError('boom in the hook')
        """)}, {"brkhook": "brk_hook"}),
    "broken-factory": ({"brk_factory": textwrap.dedent("""
        from pluginfer.core.hookspecs import BackendSpec, ModelSpec, QuantSpec, hookimpl

        @hookimpl
        def pluginfer_models():
            return [ModelSpec(name="brokenmodel", factory="brk_factory_impl:build",
                              architectures=("BrokenForCausalLM",))]

        @hookimpl
        def pluginfer_quant_methods():
            return [QuantSpec(name="brokenquant", factory="brk_factory_impl:build",
                              claims="brk_factory_impl:claims")]

        @hookimpl
        def pluginfer_backends():
            return [BackendSpec(name="brokenbackend", factory="brk_factory_impl:build",
                                check="brk_factory_impl:check", priority=1000)]
        """), "brk_factory_impl": "raise ImportError('boom when the factory module is imported')"},
        {"brkfactory": "brk_factory"}),
}


def test_broken_plugins_never_take_down_a_server_that_does_not_use_them(tiny_llama_checkpoint, tmp_path: Path):
    """Plugins that raise at import, exit at import, raise in their hook, or whose factory, claims and check
    modules cannot be imported: `pluginfer plugins` lists them as broken, and `pluginfer serve` serves."""
    site = tmp_path / "site"
    site.mkdir()
    for dist, (modules, entry_points) in BROKEN_PLUGINS.items():
        make_dist(site, dist, modules=modules, entry_points=entry_points)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    listing = subprocess.run([sys.executable, "-m", "pluginfer", "plugins"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    for expected in ("boom at import", "SystemExit: 3", "boom in the hook"):
        assert expected in listing.stdout, listing.stdout
    process = subprocess.Popen(
        [sys.executable, "-m", "pluginfer", "serve", "--model", str(tiny_llama_checkpoint[0]), "--port", "0",
         "--dtype", "float32", "--num-blocks", "64", "--block-size", "8", "--served-model-name", MODEL_NAME],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert "serving" in line, (line, process.stderr.read() if process.poll() is not None else "")
        url = line.split(" on ")[-1].strip()

        class Server:  # what tests.server.conftest.http needs
            pass

        server = Server()
        server.url = url
        status, _, raw = http(server, "POST", "/v1/completions",
                              {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] >= 1, raw
    finally:
        process.terminate()
        process.wait(timeout=30)
