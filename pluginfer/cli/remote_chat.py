"""``pluginfer chat --base-url URL``: multi-turn chat with a running OpenAI-compatible server, streamed.

Also the small client pieces ``pluginfer bench serve`` shares: the server's root, its model list,
and the ``data:`` lines of a server-sent event stream.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

from pluginfer.cli.chat_loop import chat_loop

# the longest wait for the next line of an answer (not for the whole answer)
READ_TIMEOUT_S = 600.0


class ServerError(RuntimeError):
    """The server refused a request (HTTP status) or reported an error inside the stream."""


def api_root(base_url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` name the same server."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def auth_headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def list_models(root: str, api_key: str | None, timeout: float = 30.0) -> list[dict]:
    """The entries of ``GET /v1/models``; [] when the server answers it with an error status."""
    request = urllib.request.Request(f"{root}/v1/models", headers=auth_headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError:
        return []
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"cannot reach {root}: {getattr(exc, 'reason', exc)}") from None
    data = body.get("data") if isinstance(body, dict) else None
    return [entry for entry in data if isinstance(entry, dict)] if isinstance(data, list) else []


def sse_data(line: bytes) -> str | None:
    """The payload of one ``data:`` line of a server-sent event stream; None for any other line."""
    text = line.decode("utf-8").strip()
    return text[len("data:"):].strip() if text.startswith("data:") else None


def error_message(body: object) -> str:
    """The ``message`` of an OpenAI error body ``{"error": {"message": ...}}``, else the body itself."""
    if isinstance(body, (str, bytes)):
        try:
            body = json.loads(body)
        except ValueError:
            return (body.decode(errors="replace") if isinstance(body, bytes) else body).strip()[:200]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def stream_chat(root: str, payload: dict, api_key: str | None, timeout: float) -> Iterator[str]:
    """Pieces of the assistant's answer as the server streams them."""
    request = urllib.request.Request(f"{root}/v1/chat/completions", data=json.dumps(payload).encode(),
                                     headers=auth_headers(api_key), method="POST")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise ServerError(f"HTTP {exc.code}: {error_message(exc.read())}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(f"cannot reach {root}: {getattr(exc, 'reason', exc)}") from None
    with response:
        for line in response:
            data = sse_data(line)
            if data is None:
                continue
            if data == "[DONE]":
                return
            event = json.loads(data)
            if not isinstance(event, dict) or "error" in event:
                raise ServerError(error_message(event))
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    yield piece


def _payload(args: argparse.Namespace, model: str, messages: list[dict]) -> dict:
    payload = {"model": model, "messages": messages, "stream": True, "max_tokens": args.max_tokens}
    optional = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "seed": args.sampling_seed, "stop": args.stop}
    payload.update({key: value for key, value in optional.items() if value is not None})
    if args.min_p:
        payload["min_p"] = args.min_p
    if args.repetition_penalty != 1.0:
        payload["repetition_penalty"] = args.repetition_penalty
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def run(args: argparse.Namespace) -> int:
    """Read user turns from stdin until an empty line or EOF; print each answer as it streams."""
    root = api_root(args.base_url)
    model = args.model
    if model is None:
        models = list_models(root, args.api_key)
        if not models:
            raise ValueError(f"{root}/v1/models lists no model: pass --model")
        model = models[0]["id"]
    def answer(messages: list[dict]) -> Iterator[str]:
        return stream_chat(root, _payload(args, model, messages), args.api_key, READ_TIMEOUT_S)

    return chat_loop(args.system, answer)
