"""Request processor plugins: the steps ``server.request_processors`` names, run on every chat and
completions request in that order (``pluginfer.core.serving.RequestProcessor``).

A processor's failure is its request's, never the server's: ``RequestProcessorError`` becomes its
status, anything else a 500 naming the processor, both in the API's error shape.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any, TypeVar

from pluginfer.core.registry import PluginError, Registry
from pluginfer.core.serving import EndpointContext, PromptRequest, RequestProcessor, RequestProcessorError
from pluginfer.engine.outputs import RequestOutput
from pluginfer.engine.sequence import SamplingParams
from pluginfer.server.errors import APIError

logger = logging.getLogger(__name__)
Result = TypeVar("Result")


class RequestProcessors:
    """The selected processors, in order; with none, every method hands its input back untouched."""

    def __init__(self, processors: list[tuple[str, RequestProcessor]] | None = None) -> None:
        self.processors = processors or []

    @classmethod
    def load(cls, names: list[str], registry: Registry,
             context: Callable[[str], EndpointContext]) -> RequestProcessors:
        """Build each named processor with its factory; one that fails is a start-up error naming it."""
        processors = []
        for name in names:
            factory = registry.load("request_processor", name)
            try:
                processors.append((name, factory(context(name))))
            except Exception as exc:
                raise PluginError(f"request processor {name!r} failed to start: {type(exc).__name__}: {exc}") from exc
        return cls(processors)

    def preprocess(self, request: PromptRequest) -> PromptRequest:
        for name, processor in self.processors:
            result = _guarded(name, "preprocess", processor.preprocess, request)
            _check(name, request, result)
            request = result
        return request

    def text(self, request: PromptRequest, text: str, final: bool) -> str:
        for name, processor in self.processors:
            text = _guarded(name, "postprocess", processor.postprocess, request, text, final)
            if not isinstance(text, str):
                raise _failed(name, f"postprocess returned {type(text).__name__}, not the text")
        return text

    def outputs(self, request: PromptRequest,
                stream: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``stream`` with each choice's text post-processed (``stream`` itself when there are no processors)."""
        return self._processed(request, stream) if self.processors else stream

    async def _processed(self, request: PromptRequest,
                         stream: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        async with aclosing(stream) as outputs:
            # closing this closes the engine's streams, which aborts them
            async for index, output in outputs:
                choices = [replace(choice, text=self.text(request, choice.text, choice.finished))
                           for choice in output.outputs]
                yield index, replace(output, outputs=choices)


def _guarded(name: str, step: str, call: Callable[..., Result], *arguments: Any) -> Result:
    try:
        return call(*arguments)
    except RequestProcessorError as exc:
        raise APIError(exc.status, f"request processor {name!r}: {exc.message}", exc.param,
                       "request_processor_error") from None
    except Exception as exc:
        logger.exception("request processor %r failed in %s", name, step)
        raise _failed(name, f"{step} raised {type(exc).__name__}: {exc}") from None


def _failed(name: str, why: str) -> APIError:
    return APIError(500, f"request processor {name!r} failed: {why}", code="request_processor_failed")


def _check(name: str, before: PromptRequest, after: Any) -> None:
    """What a processor hands back must still be this request (a 500 naming it otherwise)."""
    if not isinstance(after, PromptRequest):
        raise _failed(name, f"preprocess returned {type(after).__name__}, not a PromptRequest")
    if after.endpoint != before.endpoint or not isinstance(after.params, SamplingParams):
        raise _failed(name, "preprocess must keep the endpoint and return SamplingParams as params")
    if before.messages is not None and not (isinstance(after.messages, list) and after.messages):
        raise _failed(name, "preprocess must return a non-empty list of messages")
    if before.prompts is not None and (not isinstance(after.prompts, list) or len(after.prompts) != len(before.prompts)):
        raise _failed(name, f"preprocess must return {len(before.prompts)} prompt(s), as the client sent")
