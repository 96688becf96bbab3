"""``POST /v1/example/echo-tokens``: a text's tokens as the served model reads them, and what it writes next."""

from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from pluginfer import SamplingParams
from pluginfer.core.serving import EndpointContext

PATH = "/v1/example/echo-tokens"
MAX_TOKENS = 64


def attach(context: EndpointContext) -> None:
    async def echo_tokens(request: web.Request) -> web.Response:
        body = await _json_object(request, context)
        text, max_tokens = body.get("text"), body.get("max_tokens", 0)
        if not isinstance(text, str) or not text:
            raise context.error(400, "text: give a non-empty string", "text")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 0 <= max_tokens <= MAX_TOKENS:
            raise context.error(400, f"max_tokens: an integer from 0 to {MAX_TOKENS}", "max_tokens")
        tokenizer = context.tokenizer
        tokens = tokenizer.encode(text, add_special_tokens=False)
        answer: dict[str, Any] = {"text": text, "tokens": tokens, "pieces": [tokenizer.decode([t]) for t in tokens],
                                  "count": len(tokens), "continuation": None}
        if max_tokens:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            final = None
            async with aclosing(context.engine.generate(tokens, params, f"echo-{uuid.uuid4().hex}")) as outputs:
                async for output in outputs:  # leaving early (the client went away) aborts the request
                    final = output
            choice = final.outputs[0]
            answer["continuation"] = {"token_ids": list(choice.token_ids), "text": choice.text}
        return web.json_response(answer)

    context.add_route("POST", PATH, echo_tokens)


async def _json_object(request: web.Request, context: EndpointContext) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise context.error(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise context.error(400, "the body must be a JSON object")
    return body
