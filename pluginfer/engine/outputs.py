"""What the engine hands back for a request: one CompletionOutput per choice."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # why the request failed, when finish_reason is "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with SamplingParams.prompt_logprobs; [0] None
    # an embedding request's result (PoolingParams), once finished
    embedding: list[float] | None = None
