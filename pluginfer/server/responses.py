"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat machinery.

A response is the chat completion of its conversation (``instructions``, then the conversation of
``previous_response_id``, then ``input``: ``responses_protocol.py``), rendered, constrained and parsed as
/v1/chat/completions does it, so both answer alike; its text is then cut into output items
(``responses_output.py``) or streamed as events (``responses_stream.py``). A finished response with
``store`` (the default) is kept in the server's ``ResponseStore`` for GET and ``previous_response_id``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from pluginfer.core.serving import PromptRequest
from pluginfer.engine.outputs import RequestOutput
from pluginfer.engine.sequence import SamplingParams
from pluginfer.server.chat import ChoiceText, render_prompt, template_kwargs, with_tools
from pluginfer.server.errors import bad_request
from pluginfer.server.grammar import compile_grammar
from pluginfer.server.limits import check_limits
from pluginfer.server.protocol import ChatCompletionRequest
from pluginfer.server.responses_input import input_messages
from pluginfer.server.responses_output import (
    ResponseEnvelope,
    assistant_message,
    item_id,
    output_items,
    usage,
)
from pluginfer.server.responses_protocol import ResponsesRequest, in_responses_terms
from pluginfer.server.responses_store import ResponseStore, StoredResponse
from pluginfer.server.responses_stream import ResponseEvents, send_events
from pluginfer.server.state import STATE, ServerState, read_body
from pluginfer.server.streaming import run_requests
from pluginfer.server.tools import ToolCalling

RESPONSE_STORE = web.AppKey("pluginfer_responses", ResponseStore)


def add_response_routes(router: web.UrlDispatcher) -> None:
    """The routes; they share the app's ``RESPONSE_STORE``."""
    router.add_post("/v1/responses", create_response)
    router.add_get("/v1/responses/{response_id}", get_response)
    router.add_delete("/v1/responses/{response_id}", delete_response)


class _Run:
    """One response's chat request on its way to the engine."""

    def __init__(self, state: ServerState, tools: ToolCalling | None, params: SamplingParams,
                 outputs: AsyncIterator[tuple[int, RequestOutput]]) -> None:
        self.state, self.tools, self.params, self.outputs = state, tools, params, outputs
        # A grammar holds from the first token: there is no <think> section to split off.
        self.reasoning = state.reasoning_parser if params.structured_outputs is None else None

    def text(self) -> ChoiceText:
        return ChoiceText(self.reasoning, self.tools)

    @property
    def constrained(self) -> bool:
        return self.tools is not None and self.tools.mode in ("required", "named")

    def reasoning_tokens(self, reasoning: str) -> int:
        """The reasoning text's length in tokens, as the tokenizer writes it (the output's own split is not kept)."""
        return len(self.state.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


async def _start(state: ServerState, chat: ChatCompletionRequest, request_id: str) -> _Run:
    """What create_chat_completion does before its answer: tools, request processors, grammars, the prompt."""
    check_limits(chat, state.config.server, state.model_info.max_model_len)
    tools = ToolCalling.from_request(chat.tools, chat.tool_choice, chat.parallel_tool_calls, state.tool_parser,
                                     state.config.server.strict_tool_schemas)
    processed = state.processors.preprocess(PromptRequest(
        "chat", request_id, chat.sampling_params(state.sampling, state.config.server.max_logprobs), chat.model,
        messages=[m.for_template() for m in chat.messages]))
    params, grammars = with_tools(state, processed.params, chat.grammar(), tools)
    for grammar, field in grammars:
        await compile_grammar(state, grammar, field)
    prompt = render_prompt(state, processed.messages or [], True, template_kwargs(state, chat, tools))
    outputs = state.processors.outputs(processed, run_requests(state, [prompt], params, request_id, "input",
                                                                     state.lora_for(chat.model)))
    return _Run(state, tools, params, outputs)


async def create_response(request: web.Request) -> web.StreamResponse:
    state, store = request.app[STATE], request.app[RESPONSE_STORE]
    body = await read_body(request, ResponsesRequest)
    state.check_model(body.model)
    if body.input is None and body.previous_response_id is None:
        raise bad_request("input: give input (a string or a list of items)", "input")
    history = store.get(body.previous_response_id, "previous_response_id").conversation \
        if body.previous_response_id is not None else []
    new = input_messages(body.input or [])
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    response_id = item_id("resp")
    with in_responses_terms():
        run = await _start(state, body.chat_request(instructions + history + new), response_id)
    envelope = ResponseEnvelope(response_id, body, state.answer_model(body.model), run.params)

    def finish(response: dict[str, Any]) -> None:
        if body.stored:
            store.put(response_id, StoredResponse(response, [*history, *new, assistant_message(response["output"])]))

    if body.stream:
        events = ResponseEvents(envelope, run.text(), run.constrained, run.reasoning_tokens, finish)
        return await send_events(request, events, run.outputs)
    final: RequestOutput | None = None
    with in_responses_terms():
        async with aclosing(run.outputs) as stream:
            async for _, output in stream:
                final = output
    assert final is not None
    message = run.text().message(final.outputs[0].text)
    incomplete = final.outputs[0].finish_reason == "length"
    items = output_items(message, incomplete)
    response = envelope("incomplete" if incomplete else "completed", items,
                        usage(final, run.reasoning_tokens(message.get("reasoning_content") or "")))
    finish(response)
    return web.json_response(response)


async def get_response(request: web.Request) -> web.Response:
    _refuse_query(request)
    return web.json_response(request.app[RESPONSE_STORE].get(request.match_info["response_id"]).body)


async def delete_response(request: web.Request) -> web.Response:
    _refuse_query(request)
    response_id = request.match_info["response_id"]
    request.app[RESPONSE_STORE].delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def _refuse_query(request: web.Request) -> None:
    for name in request.query:
        # stream, starting_after, include: a stored response is only read back whole
        raise bad_request(f"{name}: query parameters are not supported; a stored response is read back whole", name)
