"""POST /v1/embeddings: one engine request per input, pooled as the checkpoint says (engine/pooling.py).

The inputs run through the engine's batched path like any prompt (they share steps with chat and
completions requests); each comes back as one vector, as floats or as base64 of little-endian float32
(what OpenAI's clients ask for by default). Inputs are embedded as given: no chat template is applied.
"""

from __future__ import annotations

import base64
import struct
import uuid
from contextlib import aclosing
from typing import Any, ClassVar, Literal

from aiohttp import web
from pydantic import ConfigDict, field_validator

from pluginfer.engine.outputs import RequestOutput
from pluginfer.engine.pooling import PoolerConfig, PoolingParams, read_pooler_config
from pluginfer.server.errors import bad_request
from pluginfer.server.state import STATE, ServerState, read_body
from pluginfer.server.streaming import run_requests
from pluginfer.server.unsupported import EMBEDDING, CheckedRequest, Unsupported

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(CheckedRequest):
    """OpenAI's CreateEmbeddingRequest."""

    model_config = ConfigDict(extra="ignore", strict=False)

    input: list[str | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    # informational: identifies the end user to OpenAI; no effect here
    user: str | None = None

    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = EMBEDDING


    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, given: Any) -> list[str | list[int]]:
        """A string, a list of strings, a list of token ids, or a list of token-id lists; none empty."""
        def is_token(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if isinstance(given, str):
            given = [given]
        elif isinstance(given, list) and given and all(is_token(t) for t in given):
            given = [given]
        if not isinstance(given, list) or not given:
            raise ValueError("must be a non-empty string, a list of strings, token ids, or lists of token ids")
        if len(given) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request, got {len(given)}")
        if not (all(isinstance(p, str) for p in given)
                or all(isinstance(p, list) and all(is_token(t) for t in p) for p in given)):
            raise ValueError("must be a string, a list of strings, token ids, or lists of token ids")
        empty = [index for index, p in enumerate(given) if len(p) == 0]
        if empty:
            raise ValueError(f"input {empty[0]} is empty; every input needs at least one token")
        return given


def pooler_of(state: ServerState) -> PoolerConfig:
    """The served checkpoint's pooling, read once (from the server's side: the engine may run elsewhere)."""
    if state.pooler is None:
        # imported here: it imports torch, which the server's process does not need to start
        from pluginfer.engine.loader import read_hf_config, resolve_model_path

        path = resolve_model_path(state.config.model, state.config.revision)
        state.pooler = read_pooler_config(path, read_hf_config(path) if path.is_dir() else {},
                                          state.config.pooling)
    return state.pooler


async def create_embedding(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, EmbeddingRequest)
    state.check_model(body.model)
    params = _pooling_params(pooler_of(state), body.dimensions)
    prefix = pooler_of(state).default_prompt
    prompts = [_tokens(state, prefix + given if isinstance(given, str) else given, index)
               for index, given in enumerate(body.input)]
    request_id = f"embd-{uuid.uuid4().hex}"
    finals: dict[int, RequestOutput] = {}
    async with aclosing(run_requests(state, prompts, params, request_id, "input",
                                              state.lora_for(body.model))) as stream:
        async for index, output in stream:
            if output.finished:
                finals[index] = output
    data = [{"object": "embedding", "index": index, "embedding": _encode(finals[index].embedding, body.encoding_format)}
            for index in range(len(prompts))]
    prompt_tokens = sum(map(len, prompts))
    return web.json_response({"object": "list", "data": data, "model": state.answer_model(body.model),
                              "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


def _pooling_params(pooler: PoolerConfig, dimensions: int | None) -> PoolingParams:
    if pooler.problem is not None:
        raise bad_request(pooler.problem, "model")
    if dimensions is not None and dimensions < 1:
        raise bad_request(f"dimensions: must be an integer >= 1, got {dimensions}", "dimensions")
    params = PoolingParams(dimensions=dimensions)
    try:
        pooler.check(params)
    except ValueError as exc:
        raise bad_request(str(exc), "dimensions") from None
    return params


def _tokens(state: ServerState, given: str | list[int], index: int) -> list[int]:
    tokens = state.tokenizer.encode(given) if isinstance(given, str) else list(given)
    limit = state.model_info.max_model_len
    if not tokens:
        raise bad_request(f"input {index} has no tokens", "input")
    if len(tokens) > limit:
        raise bad_request(f"input {index} has {len(tokens)} tokens, more than the model's context of {limit} "
                          "tokens", "input")
    return tokens


def _encode(embedding: list[float] | None, encoding_format: str) -> list[float] | str:
    if embedding is None:
        raise RuntimeError("an embedding request finished without its embedding")
    if encoding_format == "base64":
        # little-endian float32, as OpenAI sends and its clients decode
        return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
    return embedding
