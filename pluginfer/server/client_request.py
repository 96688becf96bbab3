"""ClientRequest: one request's output on the server's side of the engine core process (``CoreProcessClient``),
grown by the ``RequestDelta``s of the core's step frames; its consumer takes snapshots (``RequestOutput``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pluginfer.engine.messages import RequestDelta
from pluginfer.engine.outputs import CompletionOutput, RequestOutput


class ClientRequest:
    """One request's output so far, grown by the core's deltas; the consumer takes snapshots."""

    __slots__ = ("loop", "waiter", "prompt", "prompt_token_ids", "prompt_logprobs", "choices", "finished",
                 "error", "num_cached_tokens", "fresh", "failure", "embedding")

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt: str | list[int], n: int) -> None:
        self.loop = loop
        self.waiter: asyncio.Future | None = None
        self.prompt = prompt if isinstance(prompt, str) else None
        self.prompt_token_ids: list[int] = [] if isinstance(prompt, str) else list(prompt)
        self.prompt_logprobs: list | None = None
        # per choice: [token ids, text, logprobs or None, finish reason]
        self.choices: list[list[Any]] = [[[], "", None, None] for _ in range(n)]
        self.finished = False
        self.error: str | None = None
        self.num_cached_tokens = 0
        self.fresh = False  # something arrived that the consumer has not taken yet
        self.failure: BaseException | None = None
        self.embedding: list[float] | None = None

    def apply(self, delta: RequestDelta) -> None:
        prompt = delta.prompt
        if prompt is not None:
            self.prompt, self.prompt_token_ids, self.prompt_logprobs = prompt.prompt, prompt.token_ids, prompt.logprobs
        for change in delta.choices:
            choice = self.choices[change.index]
            choice[0] += change.token_ids
            if change.text:
                choice[1] += change.text
            if change.logprobs is not None:
                choice[2] = (choice[2] or []) + change.logprobs
            choice[3] = change.finish_reason
        self.finished, self.error, self.num_cached_tokens = delta.finished, delta.error, delta.num_cached_tokens
        if delta.embedding is not None:
            self.embedding = delta.embedding
        self.fresh = True
        self.wake()

    def fail(self, failure: BaseException) -> None:
        if self.failure is None:
            self.failure = failure
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def snapshot(self, request_id: str) -> RequestOutput:
        self.fresh = False
        completions = [CompletionOutput(index=index, text=text, token_ids=list(tokens),
                                        logprobs=list(logprobs) if logprobs is not None else None,
                                        finish_reason=reason)
                       for index, (tokens, text, logprobs, reason) in enumerate(self.choices)]
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, completions, finished=self.finished,
                             error=self.error, num_cached_tokens=self.num_cached_tokens,
                             prompt_logprobs=self.prompt_logprobs, embedding=self.embedding)
