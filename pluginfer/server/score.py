"""POST /v1/score (vLLM's shape) and /v1/rerank (Jina's and Cohere's shape; also /rerank and /v2/rerank).

Each pair of texts is one engine request, encoded as the tokenizer encodes a pair and scored by the model
(``engine/scoring.py``: a cross-encoder, or a causal LM served with ``--score-tokens``); the requests run batched
with everything else. A model that cannot score answers 400 saying why.
"""

from __future__ import annotations

import functools
import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator, model_validator

from pluginfer.engine.pooling import PoolingParams
from pluginfer.engine.scoring import encode_pair, score_pairs, uses_token_types
from pluginfer.server.errors import bad_request
from pluginfer.server.state import STATE, ServerState, read_body
from pluginfer.server.streaming import run_requests
from pluginfer.server.unsupported import check_fields

MAX_PAIRS = 2048  # as many inputs as one embeddings request may have


class _KnownFields(BaseModel):
    """A request model whose unknown fields are a 400 naming them."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        return check_fields(data, set(cls.model_fields), {})


def _texts(given: Any, name: str) -> Any:
    texts = [given] if isinstance(given, str) else given
    if isinstance(texts, list):
        if not texts:
            raise ValueError(f"{name}: give at least one text")
        if len(texts) > MAX_PAIRS:
            raise ValueError(f"{name}: at most {MAX_PAIRS} texts, got {len(texts)}")
        empty = [index for index, text in enumerate(texts) if isinstance(text, str) and not text]
        if empty:
            raise ValueError(f"{name}: text {empty[0]} is empty")
    return given


class ScoreRequest(_KnownFields):
    """vLLM's ScoreRequest: ``text_1`` against each ``text_2`` (1:N) or side by side (N:N)."""

    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    user: str | None = None  # informational

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _check_texts(cls, given: Any, info: Any) -> Any:
        return _texts(given, info.field_name)


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: StrictStr


class RerankRequest(_KnownFields):
    """Jina's / Cohere's rerank request: the documents best matching ``query``, best first."""

    model: str | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: int | None = Field(None, ge=1)
    return_documents: StrictBool = True
    user: str | None = None  # informational

    @field_validator("query", mode="before")
    @classmethod
    def _check_query(cls, given: Any) -> Any:
        if given == "":
            raise ValueError("query: give a non-empty query")
        return given

    @field_validator("documents", mode="before")
    @classmethod
    def _check_documents(cls, given: Any) -> Any:
        texts = [d.get("text") if isinstance(d, dict) else d for d in given] if isinstance(given, list) else given
        _texts(texts, "documents")
        return given


@functools.lru_cache(maxsize=4)
def _token_types(model: str, revision: str | None) -> bool:
    from pluginfer.engine.loader import read_hf_config, resolve_model_path  # torch: not needed to start

    path = resolve_model_path(model, revision)
    return uses_token_types(read_hf_config(path) if path.is_dir() else {})


async def _scores(state: ServerState, pairs: list[tuple[str, str]], kind: str, field: str,
                  model: str | None) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens spent (``model``: the request's, which may name a LoRA adapter)."""
    if len(pairs) > MAX_PAIRS:
        raise bad_request(f"at most {MAX_PAIRS} pairs per request, got {len(pairs)}", field)
    types = _token_types(state.config.model, state.config.revision)
    prompts = [encode_pair(state.tokenizer, first, second, types) for first, second in pairs]
    limit = state.model_info.max_model_len
    for index, prompt in enumerate(prompts):
        if len(prompt) > limit:
            raise bad_request(f"pair {index} has {len(prompt)} tokens, more than the model's context of {limit} "
                              "tokens", field)
    scores: dict[int, float] = {}
    request_id = f"{kind}-{uuid.uuid4().hex}"
    async with aclosing(run_requests(state, prompts, PoolingParams(task="score"), request_id, field,
                                     state.lora_for(model))) as stream:
        async for index, output in stream:
            if output.finished:
                scores[index] = output.embedding[0]
    return [scores[index] for index in range(len(prompts))], sum(map(len, prompts))


async def create_score(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, ScoreRequest)
    state.check_model(body.model)
    try:
        pairs = score_pairs(body.text_1, body.text_2)
    except ValueError as exc:
        raise bad_request(str(exc), "text_2") from None
    scores, tokens = await _scores(state, pairs, "score", "text_1", body.model)
    data = [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)]
    return web.json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": state.answer_model(body.model), "data": data,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def create_rerank(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, RerankRequest)
    state.check_model(body.model)
    texts = [doc.text if isinstance(doc, RerankDocument) else doc for doc in body.documents]
    scores, tokens = await _scores(state, [(body.query, text) for text in texts], "rerank", "documents", body.model)
    ranked = sorted(range(len(texts)), key=lambda index: -scores[index])[: body.top_n]
    results = [{"index": index, "relevance_score": scores[index],
                **({"document": {"text": texts[index]}} if body.return_documents else {})} for index in ranked]
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": state.answer_model(body.model),
                              "results": results,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def add_score_routes(router: web.UrlDispatcher) -> None:
    """/v1/score and /score, /v1/rerank with vLLM's aliases /rerank and /v2/rerank."""
    for path in ("/v1/score", "/score"):
        router.add_post(path, create_score)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        router.add_post(path, create_rerank)
