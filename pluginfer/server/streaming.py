"""Server-sent events, and running a handler's engine requests as one stream of outputs.

``run_requests`` is the one place where requests meet the engine: it starts one engine
request per prompt, merges their outputs, feeds the metrics, turns an engine failure into
an APIError, and, when its consumer goes away (client disconnect cancels the handler),
closes every engine stream, which aborts the requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from json.encoder import encode_basestring_ascii
from typing import Any

from aiohttp import web

from pluginfer.engine.client import EngineDeadError
from pluginfer.engine.lora_request import LoRARequest
from pluginfer.engine.outputs import RequestOutput
from pluginfer.engine.pooling import PoolingParams
from pluginfer.engine.sequence import SamplingParams
from pluginfer.server.access_log import count_tokens
from pluginfer.server.errors import APIError, bad_request, from_sampling_error, sse_error
from pluginfer.server.state import ServerState

logger = logging.getLogger(__name__)
_END = object()
# Set on a request whose client closed the connection mid-stream (a typed key: aiohttp warns of a plain string).
CLIENT_LEFT = web.RequestKey("pluginfer_client_left", bool)


HOLE = object()  # a value an EventTemplate fills per event
_MARK = "\x00pluginfer-hole\x00"
_ENCODED_MARK = json.dumps(_MARK)


def json_string(text: str) -> str:
    """``text`` as JSON, as ``json.dumps`` writes it (ASCII, escaped), without its Python overhead."""
    return encode_basestring_ascii(text)


def _event(payload: dict[str, Any], default: Any = None) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), default=default)}\n\n"


class EventTemplate:
    """One kind of event as text with holes: the chunk's JSON is written once per request, and each event
    only encodes what changes (the new text, the finish reason). ``fill`` gives the same bytes as
    ``EventStream.send`` of the chunk with those values in place of the HOLEs (in the JSON's order)."""

    def __init__(self, payload: dict[str, Any]) -> None:
        def mark(value: Any) -> str:
            if value is HOLE:
                return _MARK
            raise TypeError(f"{type(value).__name__} is not JSON serializable")

        self.parts = _event(payload, mark).split(_ENCODED_MARK)

    def fill(self, *values: str) -> bytes:
        """The event with each hole replaced by a JSON value (``json_string(text)``, ``"null"``, ``"3"``)."""
        parts = self.parts
        if len(values) != len(parts) - 1:
            raise ValueError(f"this template has {len(parts) - 1} holes, got {len(values)} values")
        pieces = [parts[0]]
        for value, part in zip(values, parts[1:]):
            pieces += (value, part)
        return "".join(pieces).encode()


def json_value(value: str | int | None) -> str:
    """A hole's value: a string, an int or None as JSON."""
    if value is None:
        return "null"
    return json_string(value) if isinstance(value, str) else str(value)


class EventStream:
    """A ``text/event-stream`` response: ``data: {json}`` events, then ``data: [DONE]``."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache"})
        self.opened = False

    async def open(self) -> None:
        """Send the headers (status 200): from here on an error can only be an event."""
        if not self.opened:
            self.opened = True
            await self.response.prepare(self.request)

    async def send(self, payload: dict[str, Any] | bytes) -> None:
        """One event: a chunk, or an event an EventTemplate made."""
        await self.response.write(payload if isinstance(payload, bytes) else _event(payload).encode())

    async def close(self, done: bytes) -> web.StreamResponse:
        await self.open()
        await self.response.write(done)
        await self.response.write_eof()
        return self.response


async def stream_response(request: web.Request, chunks: AsyncIterator[dict[str, Any] | bytes],
                          error_event: Callable[[APIError], bytes] = sse_error,
                          done: bytes = b"data: [DONE]\n\n") -> web.StreamResponse:
    """Send each chunk as an event. An error before the first chunk is an ordinary HTTP error
    (so e.g. a prompt longer than the context is a 400); after it, ``error_event(error)`` in the API's own
    shape. Then ``done``: OpenAI's ``[DONE]``; the Messages and Responses APIs end with nothing."""
    events = EventStream(request)
    try:
        try:
            async with aclosing(chunks) as stream:
                async for chunk in stream:
                    await events.open()
                    await events.send(chunk)
        except APIError as exc:
            if not events.opened:
                raise
            await events.send(error_event(exc))
        except ConnectionError:
            raise
        except Exception as exc:
            if not events.opened:
                raise
            logger.exception("error while streaming %s", request.path)
            await events.send(error_event(APIError(500, f"internal server error: {type(exc).__name__}: {exc}")))
        return await events.close(done)
    except ConnectionError:  # the client left mid-stream (closing the chunks aborted its requests): not an error
        request[CLIENT_LEFT] = True  # counted as a 499 in the metrics
        logger.debug("the client of %s left mid-stream", request.path)
        return events.response


async def run_requests(state: ServerState, prompts: list[list[int]], params: SamplingParams | PoolingParams,
                       request_id: str, prompt_field: str,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as the engine makes progress; raises APIError if a request fails.

    ``prompt_field`` is the request field a prompt the engine refuses is blamed on; ``lora_request``: the LoRA
    adapter the request's ``model`` named.
    """
    state.admit()
    ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
    timers = [state.metrics.timer() for _ in prompts]
    if isinstance(params, PoolingParams):
        streams = [state.engine.encode(prompt, params, rid, lora_request) for prompt, rid in zip(prompts, ids)]
    elif lora_request is not None:
        streams = [state.engine.generate(prompt, params, rid, lora_request=lora_request)
                   for prompt, rid in zip(prompts, ids)]
    else:
        streams = [state.engine.generate(prompt, params, rid) for prompt, rid in zip(prompts, ids)]
    # the common case: its outputs as they come, without a merging layer per token
    single = len(streams) == 1
    try:
        async with aclosing(streams[0] if single else _merge(streams)) as source:
            async for item in source:
                index, output = (0, item) if single else item
                timers[index].observe(output)
                if output.finished:
                    _check_finished(output, prompt_field)
                yield index, output
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_unavailable") from None
    except ValueError as exc:
        # the engine refused the request: a sampling field it names, else the prompt
        error = from_sampling_error(exc)
        raise (error if error.param else bad_request(str(exc), prompt_field)) from None
    finally:
        for timer in timers:
            timer.close()
        count_tokens(request_id, sum(t.num_prompt_tokens for t in timers), sum(t.num_generated for t in timers))


def _check_finished(output: RequestOutput, prompt_field: str) -> None:
    reasons = {choice.finish_reason for choice in output.outputs}
    if "failed" in reasons:
        # the engine step running it raised (logged there); the engine goes on
        raise APIError(500, output.error or "the engine step running this request failed", code="engine_step_failed")
    if "error" in reasons or output.error:
        # e.g. a prompt longer than the context: the message says by how much
        raise bad_request(output.error or "the request could not run", prompt_field)
    if "abort" in reasons:
        raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come; closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for output in stream:
                    queue.put_nowait((index, output))
            queue.put_nowait((index, _END))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
