"""schemathesis hooks (``SCHEMATHESIS_HOOKS=tests.server.fuzz_hooks``) for tests/server/test_fuzz.py and
benchmarks/fuzz.py: every other generated body names the served model (``PLUGINFER_FUZZ_MODEL``) and leaves
out the fields this server refuses, so that it gets past them to the engine; the rest go as generated."""

from __future__ import annotations

import itertools
import os

import schemathesis

from pluginfer.server.unsupported import CHAT, COMPLETION, RESPONSES

REFUSED = frozenset(CHAT) | frozenset(COMPLETION) | frozenset(RESPONSES)
_counter = itertools.count()


@schemathesis.hook
def map_body(context: object, body: object) -> object:
    if isinstance(body, dict) and next(_counter) % 2 == 0:
        body = {key: value for key, value in body.items() if key not in REFUSED}
        body["model"] = os.environ.get("PLUGINFER_FUZZ_MODEL", "tiny-llama")
    return body
