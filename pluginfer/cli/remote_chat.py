"""``pluginfer chat --base-url URL``: multi-turn chat with a running OpenAI-compatible server, streamed."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

import aiohttp

from pluginfer.cli.chat_loop import TurnEnd, chat_loop, sampling_note
from pluginfer.cli.openai_client import api_root, list_models, stream_chat

# the longest wait for the next piece of an answer (not for the whole answer)
READ_TIMEOUT_S = 600.0


def _payload(args: argparse.Namespace, model: str, messages: list[dict]) -> dict:
    payload = {"model": model, "messages": messages, "stream": True, "max_tokens": args.max_tokens}
    # unset: the server's defaults (its config's, else the model's generation_config.json)
    optional = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                "repetition_penalty": args.repetition_penalty, "seed": args.sampling_seed, "stop": args.stop}
    payload.update({key: value for key, value in optional.items() if value is not None})
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload


Item = TypeVar("Item")


def _iterate(loop: asyncio.AbstractEventLoop, pieces: AsyncIterator[Item]) -> Iterator[Item]:
    """An async iterator driven one item at a time on ``loop``, for the synchronous chat loop."""
    try:
        while True:
            try:
                yield loop.run_until_complete(pieces.__anext__())
            except StopAsyncIteration:
                return
    finally:
        with contextlib.suppress(RuntimeError):  # still running after a Ctrl-C: the loop's close ends it
            loop.run_until_complete(pieces.aclose())


def run(args: argparse.Namespace) -> int:
    """Read user turns from stdin until an empty line or EOF; print each answer as it streams."""
    root = api_root(args.base_url)

    async def open_session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    loop = asyncio.new_event_loop()
    session = loop.run_until_complete(open_session())
    try:
        model, defaults = args.model, {}
        if model is None:
            models = loop.run_until_complete(list_models(session, root, args.api_key))
            if not models:
                raise ValueError(f"{root}/v1/models lists no model: pass --model")
            model = models[0]["id"]
            defaults = models[0].get("sampling_defaults") or {}  # what the server gives fields left out
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        sampling = sampling_note({name: getattr(args, name) if getattr(args, name) is not None else defaults.get(name)
                                  for name in names})

        def answer(messages: list[dict]) -> Iterator[str | TurnEnd]:
            return _iterate(loop, stream_chat(session, root, _payload(args, model, messages), args.api_key,
                                              READ_TIMEOUT_S))

        return chat_loop(args.system, answer, model=model, max_tokens=args.max_tokens, sampling=sampling)
    finally:
        loop.run_until_complete(session.close())
        loop.close()
