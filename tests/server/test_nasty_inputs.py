"""Hand-made hostile requests: each is a clear 4xx in OpenAI's error shape, and the next request is served.

Invalid UTF-8, a 100 MB body, deeply nested JSON, NaN and Infinity, negative and huge
``max_tokens``, ``logit_bias`` ids outside the vocabulary, 10,000 stop strings, ``n`` = 10,000, a prompt of
the whole context plus one, a ``model`` that looks like a path, absurd stream options.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.server.conftest import MODEL_NAME, http

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CONTEXT = 256  # the tiny llama's max_position_embeddings
VOCAB = 1882


def _error(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def _still_serves(server) -> None:
    """The next ordinary request is answered correctly."""
    status, _, raw = http(server, "POST", "/v1/completions",
                          {"model": MODEL_NAME, "prompt": [11, 12, 13], "max_tokens": 3, "temperature": 0,
                           "ignore_eos": True})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "length" and json.loads(raw)["usage"]["completion_tokens"] == 3


def _raw_post(server, path: str, data: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    return http(server, "POST", path, data=data, headers={"Content-Type": content_type})[::2]


NASTY_JSON = [
    pytest.param(b'{"model": "tiny-llama", "prompt": "\xff\xfe\xfa"}', id="invalid-utf8"),
    pytest.param(b'{"prompt": "hi", "max_tokens": 2, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                 id="deeply-nested"),
    pytest.param(b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', id="nan"),
    pytest.param(b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}', id="infinity"),
    pytest.param(b'{"prompt": "hi", "max_tokens": 2, "top_p": -Infinity}', id="minus-infinity"),
    pytest.param(b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e999}', id="overflowing-float"),
    pytest.param(b'{"prompt": "hi", "max_tokens": 2, "seed": ' + b"9" * 5000 + b"}", id="5000-digit-int"),
    pytest.param(b'{"prompt": "hi"', id="truncated"),
    pytest.param(b"", id="empty"),
    pytest.param(b"\x00" * 1000, id="nul-bytes"),
    pytest.param(b'{"prompt": "hi", "prompt": 5}', id="duplicate-key"),
]


@pytest.mark.parametrize("data", NASTY_JSON)
def test_malformed_bodies_are_400(server, data):
    status, raw = _raw_post(server, "/v1/completions", data)
    assert status == 400, raw[:300]
    assert _error(raw)["type"] == "invalid_request_error"
    _still_serves(server)


def test_a_100_mb_body_is_413_without_being_read(server):
    """The server answers 413 from Content-Length alone; the client is never made to send 100 MB."""
    size = 100 * 1024 * 1024
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {size}\r\n\r\n".encode() + b'{"prompt": "' + b"a" * 65536)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply) < reply.index(b"\r\n\r\n") + 4 + _length(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    error = _error(body[:_length(reply)])
    assert error["code"] == "request_too_large"
    _still_serves(server)


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def test_a_chunked_body_over_the_limit_is_413(server):
    """Without a Content-Length, reading stops at the limit (aiohttp counts as it reads)."""
    limit = server.config.server.max_request_bytes
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"a" * 65536
        sent = 0
        try:
            while sent <= limit + len(piece):
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(30)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    _still_serves(server)


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": CONTEXT + 1}, "max_tokens"),
    ({"logit_bias": {str(VOCAB): 5}}, "logit_bias"),
    ({"logit_bias": {str(10**30): 5}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(VOCAB + 1)}}, "logit_bias"),
    ({"stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ({"stop": ["x" * 10_000]}, "stop"),
    ({"stop_token_ids": list(range(10_000))}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB + 5]}, "stop_token_ids"),
    ({"n": 10_000}, "n"),
    ({"n": -1}, "n"),
    ({"n": 10**20}, "n"),
    ({"logprobs": 10_000}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"min_tokens": 10**20}, "min_tokens"),
    ({"prompt": list(range(10, 10 + CONTEXT + 1))}, "prompt"),
    ({"prompt": [list(range(10, 10 + CONTEXT + 1))]}, "prompt"),
    ({"prompt": "hello " * 400}, "prompt"),
    ({"prompt": [[1, 2]] * 10_000}, "prompt"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [[-7075, -6246515, 39961]], "echo": True}, "prompt"),  # found by benchmarks/fuzz.py: was a 500
    ({"prompt": [2**40], "echo": True, "logprobs": 1}, "prompt"),
    ({"model": "/etc/passwd"}, "model"),
    ({"model": "../../../../tmp"}, "model"),
    ({"stream": True, "stream_options": {"include_usage": "yes please"}}, "stream_options.include_usage"),
    ({"temperature": [1]}, "temperature"),
    ({"echo": True, "logprobs": 1, "prompt": "a", "max_tokens": 1, "n": 10_000}, "n"),
])
def test_hostile_fields_are_400_naming_the_field(server, fields, param):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}
    status, _, raw = http(server, "POST", "/v1/completions", body)
    assert status in (400, 404), raw[:300]
    error = _error(raw)
    assert error["param"] == param, error
    _still_serves(server)


def test_the_model_field_never_opens_a_path(server, tmp_path):
    """A name that is an existing checkpoint directory is still just a name: 404, nothing is loaded."""
    for name in (str(server.config.model), str(tmp_path), "demo"):
        status, _, raw = http(server, "POST", "/v1/chat/completions", {**CHAT, "model": name})
        assert status == 404 and _error(raw)["code"] == "model_not_found"
    _still_serves(server)


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 10_000}, "n"),
    ({"max_completion_tokens": 10**30}, "max_completion_tokens"),
    ({"stop": ["a"] * 10_000}, "stop"),
    ({"top_logprobs": 10_000, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hello " * 400}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 100_000}]}, "messages"),
])
def test_hostile_chat_fields_are_400(server, fields, param):
    status, _, raw = http(server, "POST", "/v1/chat/completions", {**CHAT, **fields})
    assert status == 400, raw[:300]
    assert _error(raw)["param"] == param
    _still_serves(server)


def test_a_body_that_is_slow_to_arrive_does_not_block_others(server):
    """A client that sends half a body and waits holds only its own connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        time.sleep(0.1)
        _still_serves(server)
