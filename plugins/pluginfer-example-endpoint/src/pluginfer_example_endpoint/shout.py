"""The ``shout`` request processor: a cap on generated tokens, a refused marker, capital letters out."""

from __future__ import annotations

from dataclasses import replace

from pluginfer.core.serving import EndpointContext, PromptRequest, RequestProcessorError

MAX_TOKENS = 16
BLOCKED = "<blocked>"


class ShoutProcessor:
    def preprocess(self, request: PromptRequest) -> PromptRequest:
        texts = [str(m.get("content") or "") for m in request.messages or []]
        texts += [p for p in request.prompts or [] if isinstance(p, str)]
        if any(BLOCKED in text for text in texts):
            field = "messages" if request.endpoint == "chat" else "prompt"
            raise RequestProcessorError(f"the prompt holds {BLOCKED}, which this server refuses", 400, field)
        params = request.params
        if params.max_tokens is None or params.max_tokens > MAX_TOKENS:
            params = replace(params, max_tokens=MAX_TOKENS, min_tokens=min(params.min_tokens, MAX_TOKENS))
        return replace(request, params=params)

    def postprocess(self, request: PromptRequest, text: str, final: bool) -> str:
        # character by character: a growing text's capitals only grow
        return text.upper()


def build(context: EndpointContext) -> ShoutProcessor:
    return ShoutProcessor()
