"""Request and sequence state, and the sampling parameters a request carries."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from pluginfer.engine.lora_request import LoRARequest
from pluginfer.engine.pooling import PoolingState
from pluginfer.engine.structured import StructuredOutputsParams

_INT64_MAX = 2**63 - 1
_GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request (the names follow vLLM and OpenAI)."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of alternatives besides the sampled token
    # logprobs of the prompt's own tokens, with this many alternatives
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> value added to its logit (OpenAI's logit_bias)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # the output must match this grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.temperature < _GREEDY_BELOW:  # as vLLM: dividing by a tiny temperature overflows
            self.temperature = 0.0

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not self.temperature >= 0 or self.temperature == float("inf"):  # also rejects NaN
            fail("temperature", "must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            fail("top_k", "must be -1, 0 (disabled) or a positive integer below 2**31")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not 1e-6 <= self.repetition_penalty <= 1e6:  # outside, float32 logits overflow to inf/0
            fail("repetition_penalty", "must be in [1e-6, 1e6]")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not -(2**63) <= self.seed <= _INT64_MAX:
            fail("seed", "must fit in a signed 64-bit integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0:
            fail("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            fail("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            fail("prompt_logprobs", "must be in [0, 20]")
        if any(not s for s in self.stop):
            fail("stop", "stop strings must not be empty")
        if self.logit_bias is not None and any(
                not isinstance(t, int) or t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias.items()):
            fail("logit_bias", "must map token ids (>= 0) to values in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away or the engine shut down
    # this request could not run (e.g. prompt longer than the context)
    ERROR = "error"
    # the step that ran it raised: the server's fault, not the request's
    FAILED = "failed"


_sequence_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: a prompt and what has been generated after it.

    A request with n > 1 holds n sequences that share the prompt's KV blocks.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # which of the request's n choices
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))
    arrival_step: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)  # [0] is None: no context
    finish_reason: FinishReason | None = None
    error: str | None = None
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # tokens found through prefix caching
    generator: object | None = None  # torch.Generator when params.seed is set
    grammar: object | None = None  # llguidance matcher when params.structured_outputs is set
    # an embedding request: its prompt is pooled, nothing is sampled
    pooling: PoolingState | None = None
    # the model's inputs for the request's media (MultiModalPrompt.inputs)
    multimodal: object | None = None
    # parent of its first prefix-cache block: blocks are shared only under the same salt
    cache_salt: bytes = b""
    lora: LoRARequest | None = None  # the adapter this sequence runs with (None: the base model)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than one token still lacks its K/V (prompt or recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the cache; prompt and output are prefilled again."""
        self.status = SequenceStatus.WAITING
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0
