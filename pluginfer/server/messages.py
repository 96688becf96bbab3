"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat endpoint's pieces.

The conversation is rendered with the chat template as ``/v1/chat/completions`` renders it (so the same
conversation gives the same text), tools go through the same tool calling (``tools.py``), and the answer
comes back as Anthropic's content blocks (``thinking`` from ``--reasoning-parser``, ``text``, ``tool_use``)
or as its stream of server-sent events (``messages_stream.py``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from pluginfer.core.parsers import ReasoningParser
from pluginfer.core.serving import PromptRequest
from pluginfer.engine.outputs import CompletionOutput, RequestOutput
from pluginfer.server.chat import render_prompt, template_kwargs, with_tools
from pluginfer.server.errors import APIError, answers_errors_as, bad_request
from pluginfer.server.grammar import compile_grammar
from pluginfer.server.limits import check_limits
from pluginfer.server.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    renamed,
    usage,
)
from pluginfer.server.messages_stream import MessageEvents, send_events
from pluginfer.server.protocol import TokenizeRequest
from pluginfer.server.state import STATE, ServerState, read_body
from pluginfer.server.streaming import run_requests
from pluginfer.server.tools import ToolCalling


@answers_errors_as(anthropic_error_body)
async def count_message_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, CountTokensRequest)
    state.check_model(body.model)
    tools, _, _ = body.openai_tools()
    try:
        # rendered as /v1/messages renders them, whatever tool_choice asks of the output
        calling = ToolCalling.from_request(tools, "none", None, None)
    except APIError as exc:
        raise renamed(exc) from None
    prompt = render_prompt(state, body.template_messages(), True, _template_kwargs(state, calling))
    return web.json_response({"input_tokens": len(prompt)})


@answers_errors_as(anthropic_error_body)
async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request, MessagesRequest)
    state.check_model(body.model)
    sampling = body.sampling_request()
    try:
        check_limits(sampling, state.config.server, state.model_info.max_model_len)
        params = sampling.sampling_params(state.sampling, state.config.server.max_logprobs)
        grammar = body.grammar()
        if grammar is not None:
            params = replace(params, structured_outputs=grammar[0])
        tools = _tool_calling(state, body)
        request_id = f"msg_{uuid.uuid4().hex}"
        processed = state.processors.preprocess(PromptRequest("chat", request_id, params, body.model,
                                                              messages=body.template_messages()))
        params, grammars = with_tools(state, processed.params, grammar, tools)
        for compiled, field in grammars:
            await compile_grammar(state, compiled, field)
    except APIError as exc:
        raise renamed(exc) from None
    prompt = render_prompt(state, processed.messages or [], True, _template_kwargs(state, tools))
    outputs = state.processors.outputs(processed, run_requests(state, [prompt], params, request_id, "messages",
                                                                     state.lora_for(body.model)))
    # A grammar holds from the first token: there is no <think> section to split off.
    reasoning = state.reasoning_parser if params.structured_outputs is None else None
    answer = MessageAnswer(state, request_id, reasoning, tools, body.stop_sequences or [], params.max_tokens,
                           state.answer_model(body.model))
    if body.stream:
        return await send_events(request, MessageEvents(answer).events(outputs))
    final: RequestOutput | None = None
    async with aclosing(outputs) as stream:
        async for _, output in stream:
            final = output
    assert final is not None
    return web.json_response(answer.message(final))


def _tool_calling(state: ServerState, body: CountTokensRequest) -> ToolCalling | None:
    tools, choice, parallel = body.openai_tools()
    if tools and choice in (None, "auto") and state.tool_parser is None:
        raise bad_request("tool_choice: auto (the default with tools) needs the server started with "
                          "--tool-call-parser; any and a named tool work without one", "tool_choice")
    try:
        return ToolCalling.from_request(tools, choice, parallel, state.tool_parser,
                                        state.config.server.strict_tool_schemas)
    except APIError as exc:
        raise renamed(exc) from None


def _template_kwargs(state: ServerState, tools: ToolCalling | None) -> dict[str, Any]:
    return template_kwargs(state, TokenizeRequest(), tools)  # this API has no chat_template_kwargs


class MessageAnswer:
    """Turns the engine's output into Anthropic's message: content blocks, stop reason, usage."""

    def __init__(self, state: ServerState, request_id: str, reasoning: Callable[[], ReasoningParser] | None,
                 tools: ToolCalling | None, stop_sequences: list[str], max_tokens: int | None, model: str) -> None:
        self.state, self.id, self.reasoning, self.tools, self.model = state, request_id, reasoning, tools, model
        self.stop_sequences, self.max_tokens = stop_sequences, max_tokens

    def cut_stop(self, choice: CompletionOutput) -> tuple[str, str | None]:
        """(text, the stop sequence that ended it): the engine keeps the matched one at the end of the text."""
        if choice.finish_reason == "stop":
            matched = [stop for stop in self.stop_sequences if choice.text.endswith(stop)]
            if matched:
                # the engine stops at the earliest match: the longest ending here
                stop = max(matched, key=len)
                return choice.text[:-len(stop)], stop
        return choice.text, None

    def stop_reason(self, output: RequestOutput, choice: CompletionOutput, stop: str | None, called: bool) -> str:
        if stop is not None:
            return "stop_sequence"
        if called and choice.finish_reason == "stop":
            return "tool_use"
        if choice.finish_reason == "length":
            if len(choice.token_ids) < (self.max_tokens or 0):
                return "model_context_window_exceeded"
            return "max_tokens"
        return "end_turn"

    def shell(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
              usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def message(self, output: RequestOutput) -> dict[str, Any]:
        [choice] = output.outputs
        text, stop = self.cut_stop(choice)
        content: list[dict[str, Any]] = []
        if self.reasoning is not None:
            thinking, text = self.reasoning().split(text, final=True)
            if thinking:
                content.append({"type": "thinking", "thinking": thinking, "signature": ""})
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            text, calls = self.tools.new_output().message(text)
        if text:
            content.append({"type": "text", "text": text})
        content += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                     "input": tool_input(call["function"]["arguments"])} for call in calls]
        return self.shell(content, self.stop_reason(output, choice, stop, bool(calls)), stop,
                          usage(output, len(choice.token_ids)))


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object; ``{}`` for arguments cut short by max_tokens (streamed
    ``input_json_delta`` events carry what was written)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}

