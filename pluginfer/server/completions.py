"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + choice index.
With ``suffix`` each prompt is the prefix of a fill-in-the-middle prompt (``text/fim.py``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from pluginfer.core.serving import PromptRequest
from pluginfer.engine.beam_search import BeamSearchParams
from pluginfer.engine.outputs import CompletionOutput, RequestOutput
from pluginfer.server.beam import beam_params, finish_reason, search
from pluginfer.server.errors import bad_request
from pluginfer.server.grammar import compile_grammar
from pluginfer.server.limits import check_limits
from pluginfer.server.logprobs import TokenText, completion_logprobs
from pluginfer.server.protocol import CompletionRequest
from pluginfer.server.state import STATE, ServerState, read_body
from pluginfer.server.streaming import (
    HOLE,
    EventTemplate,
    json_string,
    json_value,
    run_requests,
    stream_response,
    usage,
)
from pluginfer.text.fim import FORMATS, FimTokens, fim_prompt


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request, CompletionRequest)
    state.check_model(body.model)
    check_limits(body, state.config.server, state.model_info.max_model_len, len(body.prompt))
    body.check_supported()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    processed = state.processors.preprocess(PromptRequest(
        "completions", request_id, body.sampling_params(state.sampling, state.config.server.max_logprobs),
        body.model, prompts=list(body.prompt)))
    if processed.prompts != body.prompt:  # a request processor rewrote them: echo shows what ran
        body = body.model_copy(update={"prompt": processed.prompts})
    params = processed.params
    grammar = body.grammar()
    if grammar is not None:
        await compile_grammar(state, *grammar)
    if body.suffix:
        fim = _fim(state)
        prompts = [fim_prompt(state.tokenizer, fim, p, body.suffix) for p in body.prompt]  # type: ignore[arg-type]
        params = replace(params, stop_token_ids=[*params.stop_token_ids, *fim.stop_token_ids])
    else:
        prompts = [state.tokenizer.encode(p) if isinstance(p, str) else p for p in body.prompt]
    # as /v1/models and /detokenize say; checked before echo decodes them
    vocab_size = state.vocab_size
    bad = [t for p in body.prompt if not isinstance(p, str) for t in p if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}", "prompt")
    beam = beam_params(body, params.max_tokens)
    if beam is not None:
        return web.json_response(await _beam_completion(state, body, prompts, beam, request_id))
    outputs = state.processors.outputs(processed, run_requests(state, prompts, params, request_id, "prompt",
                                                                     state.lora_for(body.model)))
    answer = _CompletionAnswer(state, body, request_id, prompts)
    if body.stream:
        return await stream_response(request, answer.chunks(outputs))
    finals: dict[int, RequestOutput] = {}
    async with aclosing(outputs) as stream:
        async for index, output in stream:
            if output.finished:
                finals[index] = output
    return web.json_response(answer.completion([finals[i] for i in range(len(prompts))]))


def _fim(state: ServerState) -> FimTokens:
    fim = state.fim
    if fim is None:
        formats = ", ".join(f"{f.name} ({f.prefix} {f.suffix} {f.middle})" for f in FORMATS)
        raise bad_request("suffix: this model's tokenizer has no fill-in-the-middle tokens; suffix needs a model "
                          f"whose tokenizer has them ({formats}, or a GGUF file's fim_pre/fim_suf/fim_mid ids)",
                          "suffix")
    return fim


async def _beam_completion(state: ServerState, body: CompletionRequest, prompts: list[list[int]],
                           beam: BeamSearchParams, request_id: str) -> dict[str, Any]:
    if body.stream:
        raise bad_request("stream: beam search answers once the search ends; use stream: false", "stream")
    results = await search(state, prompts, beam, request_id, "prompt", state.lora_for(body.model))
    eos = state.model_info.eos_token_ids
    choices = [{"index": i * body.n + j, "text": b.text, "logprobs": None, "finish_reason": finish_reason(b, eos)}
               for i, beams in enumerate(results) for j, b in enumerate(beams)]
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": state.answer_model(body.model), "choices": choices,
            "usage": usage(sum(map(len, prompts)), sum(len(b.token_ids) for beams in results for b in beams))}


class _CompletionAnswer:
    """Builds the response body, or the chunks of the stream, from the engine's outputs."""

    def __init__(self, state: ServerState, body: CompletionRequest, request_id: str,
                 prompts: list[list[int]]) -> None:
        self.state, self.body, self.id = state, body, request_id
        self.created = int(time.time())
        self.text_of = TokenText(state.tokenizer)
        self.echo = [self._prompt_text(given, ids) for given, ids in zip(body.prompt, prompts)] \
            if body.echo else [""] * len(prompts)

    def _prompt_text(self, given: str | list[int], ids: list[int]) -> str:
        return given if isinstance(given, str) else self.state.tokenizer.decode(ids)

    def _logprobs(self, choice: CompletionOutput, start: int, offset: int,
                  echoed: RequestOutput | None = None) -> dict[str, Any] | None:
        """The choice's token logprobs from ``start``; with ``echoed``, its prompt's come first (echo)."""
        if choice.logprobs is None:
            return None
        token_ids, logprobs = choice.token_ids[start:], choice.logprobs[start:]
        if echoed is not None and echoed.prompt_logprobs is not None:
            token_ids = echoed.prompt_token_ids + token_ids
            logprobs = echoed.prompt_logprobs + logprobs
            offset = 0
        return completion_logprobs(self.text_of, token_ids, logprobs, self.body.logprobs or 0, offset)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.state.answer_model(self.body.model), "choices": choices}

    def completion(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for prompt_index, output in enumerate(outputs):
            echo = self.echo[prompt_index]
            for choice in output.outputs:
                choices.append({"index": prompt_index * self.body.n + choice.index, "text": echo + choice.text,
                                "logprobs": self._logprobs(choice, 0, len(echo), output if echo else None),
                                "finish_reason": choice.finish_reason})
        body = self._chunk(choices)
        body["usage"] = usage(sum(len(o.prompt_token_ids) for o in outputs),
                              sum(len(c.token_ids) for o in outputs for c in o.outputs),
                              sum(o.num_cached_tokens for o in outputs))
        return body

    async def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any] | bytes]:
        """Text deltas (the echoed prompt first); each choice's last chunk alone carries its finish_reason.
        A chunk of text alone (no logprobs, no usage) is an event filled in from a template: once a token."""
        template = EventTemplate(self._chunk([{"index": HOLE, "text": HOLE, "logprobs": None,
                                               "finish_reason": HOLE}]))
        n = self.body.n
        count = n * len(self.echo)
        sent_text, sent_tokens, finished = [0] * count, [0] * count, [False] * count
        started = [False] * count
        prompt_tokens, generated = [0] * len(self.echo), [0] * len(self.echo)
        cached = 0
        async with aclosing(outputs) as stream:
            async for prompt_index, output in stream:
                prompt_tokens[prompt_index] = len(output.prompt_token_ids)
                generated[prompt_index] = sum(len(c.token_ids) for c in output.outputs)
                if output.finished:
                    cached += output.num_cached_tokens
                for choice in output.outputs:
                    i, done = prompt_index * n + choice.index, choice.finish_reason is not None
                    if finished[i] or (not choice.token_ids and not done):
                        # nothing generated yet (e.g. a prompt still being prefilled in chunks)
                        continue
                    prefix = "" if started[i] else self.echo[prompt_index]
                    text = prefix + choice.text[sent_text[i]:]
                    new_tokens = len(choice.token_ids) > sent_tokens[i]
                    if not (text or done or (new_tokens and choice.logprobs is not None)):
                        continue
                    offset = len(self.echo[prompt_index]) + sent_text[i]
                    echoed = output if self.body.echo and not started[i] else None
                    logprobs = self._logprobs(choice, sent_tokens[i], offset, echoed)
                    started[i], finished[i] = True, done
                    sent_text[i], sent_tokens[i] = len(choice.text), len(choice.token_ids)
                    if logprobs is None and not self.body.continuous_usage:
                        yield template.fill(str(i), json_string(text), json_value(choice.finish_reason))
                        continue
                    chunk = self._chunk([{"index": i, "text": text, "logprobs": logprobs,
                                          "finish_reason": choice.finish_reason}])
                    if self.body.continuous_usage:
                        chunk["usage"] = usage(prompt_tokens[prompt_index], generated[prompt_index])
                    yield chunk
        if self.body.include_usage:
            chunk = self._chunk([])
            chunk["usage"] = usage(sum(prompt_tokens), sum(generated), cached)
            yield chunk
