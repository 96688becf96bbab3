"""POST /v1/chat/completions: render the conversation with the chat template, generate, answer or stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from pluginfer.core.outputs import CompletionOutput, RequestOutput
from pluginfer.core.tokenizer import render_chat
from pluginfer.server.errors import bad_request
from pluginfer.server.grammar import compile_grammar
from pluginfer.server.logprobs import TokenText, chat_logprobs
from pluginfer.server.protocol import ChatCompletionRequest
from pluginfer.server.reasoning import ReasoningStream
from pluginfer.server.state import STATE, ServerState, read_body
from pluginfer.server.streaming import run_requests, stream_response, usage


def render_prompt(state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool,
                  template_kwargs: dict[str, Any] | None) -> list[int]:
    """The conversation's prompt token ids; a template that fails on this input is a 400."""
    reserved = {"tokenize", "add_generation_prompt", "conversation", "messages"} & set(template_kwargs or {})
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
    try:
        text = render_chat(state.tokenizer, messages, add_generation_prompt, **(template_kwargs or {}))
    except Exception as exc:  # a missing template, or one that rejects these messages (raise_exception)
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
    return state.tokenizer.encode(text, add_special_tokens=False)


def template_kwargs(state: ServerState, body: ChatCompletionRequest) -> dict[str, Any]:
    """``chat_template_kwargs``, and ``reasoning_effort`` for a template that reads it (else a 400)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        if "reasoning_effort" not in str(getattr(state.tokenizer, "chat_template", None) or ""):
            raise bad_request("reasoning_effort: this model's chat template does not read it",
                              "reasoning_effort")
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    params = body.sampling_params(state.config.sampling, state.config.server.max_logprobs)
    grammar = body.grammar()
    if grammar is not None:
        await compile_grammar(state, *grammar)
    prompt = render_prompt(state, [m.for_template() for m in body.messages], body.add_generation_prompt,
                           template_kwargs(state, body))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    outputs = run_requests(state, [prompt], params, request_id, "messages")
    answer = _ChatAnswer(state, body, request_id)
    if body.stream:
        return await stream_response(request, answer.chunks(outputs))
    final: RequestOutput | None = None
    async with aclosing(outputs) as stream:
        async for _, output in stream:
            final = output
    assert final is not None
    return web.json_response(answer.completion(final))


class _ChatAnswer:
    """Builds the response body, or the chunks of the stream, from the engine's outputs."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str) -> None:
        self.state, self.body, self.id = state, body, request_id
        self.created = int(time.time())
        self.text_of = TokenText(state.tokenizer)
        self.top_count = body.top_logprobs or 0

    def _logprobs(self, choice: CompletionOutput, start: int = 0) -> dict[str, Any] | None:
        if choice.logprobs is None:
            return None
        return chat_logprobs(self.text_of, choice.token_ids[start:], choice.logprobs[start:], self.top_count)

    def completion(self, output: RequestOutput) -> dict[str, Any]:
        choices = []
        for choice in output.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            if self.state.reasoning_parser is not None:
                reasoning, content = self.state.reasoning_parser().split(choice.text, final=True)
                message.update(content=content, reasoning_content=reasoning or None)
            choices.append({"index": choice.index, "message": message, "logprobs": self._logprobs(choice),
                            "finish_reason": choice.finish_reason})
        generated = sum(len(choice.token_ids) for choice in output.outputs)
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.state.model_name, "choices": choices,
                "usage": usage(len(output.prompt_token_ids), generated, output.num_cached_tokens)}

    def _chunk(self, choices: list[dict[str, Any]], output: RequestOutput | None = None) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.state.model_name, "choices": choices}
        if output is not None and self.body.continuous_usage:
            chunk["usage"] = usage(len(output.prompt_token_ids),
                                   sum(len(choice.token_ids) for choice in output.outputs))
        return chunk

    async def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        """The role first, then text deltas; each choice's last chunk alone carries its finish_reason."""
        n = self.body.n
        sent_tokens, started, finished = [0] * n, [False] * n, [False] * n
        parser = self.state.reasoning_parser
        splitters = [ReasoningStream(parser()) for _ in range(n)] if parser else None
        sent_text = [0] * n
        last: RequestOutput | None = None
        async with aclosing(outputs) as stream:
            async for _, output in stream:
                last = output
                for choice in output.outputs:
                    i, done = choice.index, choice.finish_reason is not None
                    if finished[i]:
                        continue
                    if not started[i]:
                        started[i] = True
                        yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], output)
                    if splitters is not None:
                        reasoning, content = splitters[i].delta(choice.text, final=done)
                        delta = {key: value for key, value in
                                 (("reasoning_content", reasoning), ("content", content)) if value}
                    else:
                        text = choice.text[sent_text[i]:]
                        sent_text[i] = len(choice.text)
                        delta = {"content": text} if text else {}
                    new_tokens = len(choice.token_ids) > sent_tokens[i]
                    if not (delta or done or (new_tokens and choice.logprobs is not None)):
                        continue
                    logprobs = self._logprobs(choice, sent_tokens[i])
                    sent_tokens[i] = len(choice.token_ids)
                    finished[i] = done
                    yield self._chunk([{"index": i, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": choice.finish_reason}], output)
        if self.body.include_usage and last is not None:
            generated = sum(len(choice.token_ids) for choice in last.outputs)
            yield {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                   "model": self.state.model_name, "choices": [],
                   "usage": usage(len(last.prompt_token_ids), generated, last.num_cached_tokens)}
