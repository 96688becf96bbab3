"""POST /v1/chat/completions: render the conversation with the chat template, generate, answer or stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from pluginfer.core.parsers import ReasoningParser
from pluginfer.core.serving import PromptRequest
from pluginfer.engine.beam_search import BeamSearchParams
from pluginfer.engine.outputs import CompletionOutput, RequestOutput
from pluginfer.engine.sequence import SamplingParams
from pluginfer.engine.structured import StructuredOutputsParams
from pluginfer.server.beam import beam_params, finish_reason, search
from pluginfer.server.errors import bad_request
from pluginfer.server.grammar import compile_grammar
from pluginfer.server.limits import check_limits
from pluginfer.server.logprobs import TokenText, chat_logprobs
from pluginfer.server.media_fetch import fetch_media
from pluginfer.server.protocol import ChatCompletionRequest, TokenizeRequest
from pluginfer.server.reasoning import ReasoningStream
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
from pluginfer.server.tool_grammar import special_tokens
from pluginfer.server.tools import ToolCalling, ToolCallOutput
from pluginfer.text.image_parts import ImagePartError, extract_images
from pluginfer.text.tokenizer import render_chat, template_renders_tools


def render_prompt(state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool,
                  template_kwargs: dict[str, Any] | None) -> list[int]:
    """The conversation's prompt token ids; a template that fails on this input is a 400."""
    reserved = {"tokenize", "add_generation_prompt", "conversation", "messages"} & set(template_kwargs or {})
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
    try:
        text = render_chat(state.tokenizer, messages, add_generation_prompt, **(template_kwargs or {}))
    except Exception as exc:
        # a missing template, or one that rejects these messages (raise_exception)
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
    return state.tokenizer.encode(text, add_special_tokens=False)


def template_kwargs(state: ServerState, body: ChatCompletionRequest | TokenizeRequest,
                    tools: ToolCalling | None) -> dict[str, Any]:
    """``chat_template_kwargs``, the tools, and ``reasoning_effort`` for a template that reads it (else a 400)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if tools is not None:
        if not template_renders_tools(getattr(state.tokenizer, "chat_template", None)):
            raise bad_request("tools: this model's chat template does not render tools", "tools")
        kwargs["tools"] = tools.template_tools()
    effort = body.reasoning_effort if isinstance(body, ChatCompletionRequest) else None  # /tokenize has none
    if effort is not None:
        if "reasoning_effort" not in str(getattr(state.tokenizer, "chat_template", None) or ""):
            raise bad_request("reasoning_effort: this model's chat template does not read it",
                              "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    check_limits(body, state.config.server, state.model_info.max_model_len)
    tools = ToolCalling.from_request(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_parser,
                                     state.config.server.strict_tool_schemas)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    processed = state.processors.preprocess(PromptRequest(
        "chat", request_id, body.sampling_params(state.sampling, state.config.server.max_logprobs),
        body.model, messages=[m.for_template() for m in body.messages]))
    params, grammars = with_tools(state, processed.params, body.grammar(), tools)
    for grammar, field in grammars:
        await compile_grammar(state, grammar, field)
    accepted = "image" in state.model_info.modalities
    server = state.config.server
    try:
        fetched = await fetch_media(processed.messages or [], server.allowed_media_domains,
                                    server.media_fetch_timeout_s, server.allowed_local_media_path) if accepted else {}
        messages, images = extract_images(processed.messages or [], accepted, fetched)
    except ImagePartError as exc:
        raise bad_request(str(exc), exc.part) from None
    prompt = render_prompt(state, messages, body.add_generation_prompt, template_kwargs(state, body, tools))
    if images:
        if beam_params(body, params.max_tokens) is not None:
            raise bad_request("beam search does not take images", "messages")
        prompt = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}
    beam = beam_params(body, params.max_tokens)
    if beam is not None:
        return web.json_response(await _beam_chat(state, body, prompt, beam, request_id))
    outputs = state.processors.outputs(processed, run_requests(state, [prompt], params, request_id, "messages",
                                                                     state.lora_for(body.model)))
    # A grammar holds from the first token: there is no <think> section to split off.
    reasoning = state.reasoning_parser if params.structured_outputs is None else None
    answer = _ChatAnswer(state, body, request_id, reasoning, tools)
    if body.stream:
        return await stream_response(request, answer.chunks(outputs))
    final: RequestOutput | None = None
    async with aclosing(outputs) as stream:
        async for _, output in stream:
            final = output
    assert final is not None
    return web.json_response(answer.completion(final))


async def _beam_chat(state: ServerState, body: ChatCompletionRequest, prompt: list[int], beam: BeamSearchParams,
                     request_id: str) -> dict[str, Any]:
    if body.stream:
        raise bad_request("stream: beam search answers once the search ends; use stream: false", "stream")
    [beams] = await search(state, [prompt], beam, request_id, "messages", state.lora_for(body.model))
    eos = state.model_info.eos_token_ids
    choices = [{"index": i, "message": {"role": "assistant", "content": b.text}, "logprobs": None,
                "finish_reason": finish_reason(b, eos)} for i, b in enumerate(beams)]
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": state.answer_model(body.model), "choices": choices,
            "usage": usage(len(prompt), sum(len(b.token_ids) for b in beams))}


def with_tools(state: ServerState, params: SamplingParams, grammar: tuple[StructuredOutputsParams, str] | None,
                tools: ToolCalling | None) -> tuple[SamplingParams, list[tuple[StructuredOutputsParams, str]]]:
    """The request's parameters with the grammar tool_choice needs, and the grammars to compile (each
    with the request field a failure names)."""
    grammars = [grammar] if grammar else []
    if tools is None:
        return params, grammars
    tool_grammar = tools.grammar()
    if tool_grammar is None and grammar is None and state.reasoning_parser is None:
        # auto: not under a reasoning parser, whose <think> section a grammar from the first token would forbid
        tool_grammar = tools.auto_grammar(special_tokens(state.tokenizer))
    if tool_grammar is None and tools.allowed is not None:
        why = grammar[1] if grammar else "the server's reasoning parser" if state.reasoning_parser else \
            "the tool call parser (its calls have no grammar)"
        raise bad_request("tool_choice: allowed_tools with mode auto needs the grammar that holds calls to the "
                          f"allowed tools, and {why} rules it out here; use mode required", "tool_choice")
    if tool_grammar is not None:
        if grammar is not None:
            raise bad_request(f"tool_choice {tools.mode} constrains the output itself; it cannot be combined "
                              f"with {grammar[1]}", "tool_choice")
        params = replace(params, structured_outputs=tool_grammar)
        grammars.append((tool_grammar, "tools"))
    if tools.parser is not None and tools.parser.needs_special_tokens:  # e.g. Mistral's [TOOL_CALLS]
        params = replace(params, skip_special_tokens=False)
        tools.special_tokens = list(getattr(state.tokenizer, "all_special_tokens", []))
    return params, tools.parameter_grammars() + grammars


class ChoiceText:
    """One choice's output text as reasoning, content and tool calls: whole, or as stream deltas."""

    def __init__(self, reasoning: Callable[[], ReasoningParser] | None, tools: ToolCalling | None) -> None:
        self.reasoning = ReasoningStream(reasoning()) if reasoning else None
        self.tools: ToolCallOutput | None = tools.new_output() if tools else None
        self.sent = 0

    @property
    def called(self) -> bool:
        return bool(self.tools and self.tools.sent_calls)

    def message(self, text: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant"}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parser.split(text, final=True)
            message["reasoning_content"] = reasoning or None
        if self.tools is None:
            message["content"] = text
            return message
        message["content"], calls = self.tools.message(text)
        if calls:
            message["tool_calls"] = calls
        return message

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            reasoning, _ = self.reasoning.delta(text, final)
            if reasoning:
                delta["reasoning_content"] = reasoning
            text = self.reasoning.content
        if self.tools is not None:
            content, calls = self.tools.delta(text, final)
            if calls:
                delta["tool_calls"] = calls
        else:
            content, self.sent = text[self.sent:], len(text)
        if content:
            delta["content"] = content
        return delta


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class _ChatAnswer:
    """Builds the response body, or the chunks of the stream, from the engine's outputs."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str,
                 reasoning: Callable[[], ReasoningParser] | None, tools: ToolCalling | None) -> None:
        self.state, self.body, self.id = state, body, request_id
        self.reasoning, self.tools = reasoning, tools
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
            message = ChoiceText(self.reasoning, self.tools).message(choice.text)
            choices.append({"index": choice.index, "message": message, "logprobs": self._logprobs(choice),
                            "finish_reason": _finish_reason(choice.finish_reason, "tool_calls" in message)})
        generated = sum(len(choice.token_ids) for choice in output.outputs)
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.state.answer_model(self.body.model), "choices": choices,
                "usage": usage(len(output.prompt_token_ids), generated, output.num_cached_tokens)}

    def _chunk(self, choices: list[dict[str, Any]], output: RequestOutput | None = None) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.state.answer_model(self.body.model), "choices": choices}
        if output is not None and self.body.continuous_usage:
            chunk["usage"] = usage(len(output.prompt_token_ids),
                                   sum(len(choice.token_ids) for choice in output.outputs))
        return chunk

    async def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any] | bytes]:
        """The role first, then text deltas; each choice's last chunk alone carries its finish_reason.
        A chunk of content alone (no logprobs, no usage) is an event filled in from a template: once a token."""
        template = EventTemplate(self._chunk([{"index": HOLE, "delta": {"content": HOLE}, "logprobs": None,
                                               "finish_reason": HOLE}]))
        plain = not self.body.continuous_usage
        n = self.body.n
        sent_tokens, started, finished = [0] * n, [False] * n, [False] * n
        texts = [ChoiceText(self.reasoning, self.tools) for _ in range(n)]
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
                    delta = texts[i].delta(choice.text, final=done)
                    new_tokens = len(choice.token_ids) > sent_tokens[i]
                    if not (delta or done or (new_tokens and choice.logprobs is not None)):
                        continue
                    logprobs = self._logprobs(choice, sent_tokens[i])
                    sent_tokens[i] = len(choice.token_ids)
                    finished[i] = done
                    reason = _finish_reason(choice.finish_reason, texts[i].called)
                    if plain and logprobs is None and len(delta) == 1 and "content" in delta:
                        yield template.fill(str(i), json_string(delta["content"]), json_value(reason))
                        continue
                    yield self._chunk([{"index": i, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": reason}], output)
        if self.body.include_usage and last is not None:
            generated = sum(len(choice.token_ids) for choice in last.outputs)
            yield {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                   "model": self.state.answer_model(self.body.model), "choices": [],
                   "usage": usage(len(last.prompt_token_ids), generated, last.num_cached_tokens)}
