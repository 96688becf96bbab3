"""Beam search, step for step as transformers' ``generate(num_beams=...)`` does it (batch of one prompt).

The search needs, per step, the top ``candidates`` next-token logprobs of each running beam: the
best candidates over all beams and the whole vocabulary lie among them. ``LLM.beam_search`` gets
them from the engine as one-token requests (``logprobs=candidates``), whose prompts share their KV
blocks through the prefix cache, as vLLM's ``LLM.beam_search`` does. Scores are float32 sums of
logprobs, length-penalised as transformers does (``score / generated_len ** length_penalty``),
with its three ``early_stopping`` modes (False: its heuristic; True: stop once ``beam_width``
beams are done; "never": the canonical search).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    # imported where used: the server imports this module, and must not import torch to start
    import torch

_NEG = -1.0e9  # transformers' "never this one"
MAX_CANDIDATES = 20  # the engine's logprobs limit


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.max_tokens < 1:
            raise ValueError("BeamSearchParams: beam_width and max_tokens must be >= 1")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"BeamSearchParams.early_stopping: True, False or 'never', got {self.early_stopping!r}")


@dataclass
class Beam:
    token_ids: list[int]  # the generated tokens (an EOS that finished it included)
    score: float  # sum of logprobs / len(token_ids) ** length_penalty
    # ended by EOS or max_tokens (False only for a beam no finished one displaced)
    finished: bool
    text: str = ""


@dataclass
class BeamSearch:
    """The search over one prompt; ``running()`` asks for logprobs, ``advance()`` takes them."""

    prompt: list[int]
    params: BeamSearchParams
    eos_token_ids: set[int]
    step: int = 0
    done: bool = False
    _running: list[list[int]] = field(default_factory=list)
    _running_scores: torch.Tensor | None = None
    _finished: list[list[int]] = field(default_factory=list)
    _finished_scores: torch.Tensor | None = None
    _finished_flags: torch.Tensor | None = None
    _improvable: bool = True

    def __post_init__(self) -> None:
        import torch

        width = self.params.beam_width
        eos = set() if self.params.ignore_eos else set(self.eos_token_ids)
        self.eos_token_ids = eos
        self.candidates = max(2, 1 + len(eos)) * width
        if self.candidates > MAX_CANDIDATES:
            raise ValueError(f"BeamSearchParams.beam_width: at most {MAX_CANDIDATES // max(2, 1 + len(eos))} "
                             f"with {len(eos)} EOS token(s) (each step looks at {self.candidates} candidates)")
        self._running = [[] for _ in range(width)]
        self._running_scores = torch.full((width,), _NEG)
        self._running_scores[0] = 0.0  # the copies of the prompt other than the first never win
        self._finished = [[] for _ in range(width)]
        self._finished_scores = torch.full((width,), _NEG)
        self._finished_flags = torch.zeros(width, dtype=torch.bool)

    def running(self) -> list[list[int]]:
        """The full token ids (prompt + generated) of each running beam, whose next-token logprobs are needed."""
        return [self.prompt + generated for generated in self._running]

    def advance(self, logprobs: list[dict[int, float]]) -> None:
        """Take the top ``candidates`` next-token logprobs of each running beam (in ``running()`` order)."""
        import torch

        width, params = self.params.beam_width, self.params
        scores, parents, tokens = [], [], []
        for beam, entry in enumerate(logprobs):
            for token, logprob in sorted(entry.items()):
                scores.append(float(torch.tensor(logprob, dtype=torch.float32) + self._running_scores[beam]))
                parents.append(beam)
                tokens.append(token)
        top = torch.topk(torch.tensor(scores, dtype=torch.float32), self.candidates)
        top_scores = top.values
        top_sequences = [self._running[parents[i]] + [tokens[i]] for i in top.indices.tolist()]
        generated = self.step + 1
        hits = torch.tensor([seq[-1] in self.eos_token_ids or generated >= params.max_tokens
                             for seq in top_sequences])

        # The best beams that did not just finish run on.
        running_scores = top_scores + hits.to(torch.float32) * _NEG
        keep = torch.topk(running_scores, width).indices
        self._running = [top_sequences[i] for i in keep.tolist()]
        self._running_scores = running_scores[keep]

        # Finished candidates among the top ``width`` join the finished beams if they score better.
        top_width = torch.arange(self.candidates) < width
        just_finished = hits & top_width
        finished_scores = top_scores / (generated ** params.length_penalty)
        if bool(self._finished_flags.all()) and params.early_stopping is True:
            finished_scores = finished_scores + _NEG
        if not self._improvable:
            finished_scores = finished_scores + _NEG
        finished_scores = finished_scores + (~just_finished).to(torch.float32) * _NEG
        merged_scores = torch.cat((self._finished_scores, finished_scores))
        merged = self._finished + top_sequences
        merged_flags = torch.cat((self._finished_flags, just_finished))
        best = torch.topk(merged_scores, width).indices
        self._finished = [merged[i] for i in best.tolist()]
        self._finished_scores = merged_scores[best]
        self._finished_flags = merged_flags[best]

        self.step = generated
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_length = params.max_tokens
        else:
            best_length = generated
        best_running = self._running_scores[:1] / (best_length ** params.length_penalty)
        worst_finished = torch.where(self._finished_flags, self._finished_scores.min(), torch.tensor(_NEG))
        self._improvable = self._improvable and bool((best_running > worst_finished).any())
        all_done = bool(self._finished_flags.all()) and params.early_stopping is True
        self.done = not self._improvable or all_done or bool(hits.all())

    def results(self) -> list[Beam]:
        """The ``beam_width`` finished beams, best first."""
        return [Beam(list(tokens), float(score), bool(flag))
                for tokens, score, flag in zip(self._finished, self._finished_scores.tolist(), self._finished_flags)]


def run_beam_search(generate: Callable[..., list[Any]], prompts: list[list[int]], params: BeamSearchParams,
                    eos_token_ids: set[int], max_model_len: int,
                    decode: Callable[[list[int]], str] | None = None,
                    lora_requests: list[Any] | None = None) -> list[list[Beam]]:
    """Search every prompt at once: each step is one ``generate(prompts, params, lora_request=...)`` call of
    one-token requests, one per distinct running beam of every unfinished search (``LLM.generate``: batched,
    prefix-cached). ``lora_requests``: each prompt's LoRA adapter (None, or a None: the base)."""
    from pluginfer.engine.sequence import SamplingParams

    longest = max(len(prompt) for prompt in prompts) + params.max_tokens
    if longest > max_model_len:
        raise ValueError(f"BeamSearchParams.max_tokens: a prompt plus {params.max_tokens} tokens is {longest}, "
                         f"over the context of {max_model_len}")
    searches = [BeamSearch(list(prompt), params, eos_token_ids) for prompt in prompts]
    step = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=searches[0].candidates,
                          skip_special_tokens=False)
    adapters = lora_requests or [None] * len(searches)
    while live := [i for i, search in enumerate(searches) if not search.done]:
        # one request per distinct (adapter, beam): the same tokens under two adapters are two requests
        wanted = list(dict.fromkeys((adapters[i], tuple(seq)) for i in live for seq in searches[i].running()))
        outputs = generate([list(seq) for _, seq in wanted], step, lora_request=[adapter for adapter, _ in wanted])
        table = {key: output.outputs[0].logprobs[0] for key, output in zip(wanted, outputs)}
        for i in live:
            searches[i].advance([table[adapters[i], tuple(seq)] for seq in searches[i].running()])
    results = [search.results() for search in searches]
    if decode is not None:
        for beams in results:
            for beam in beams:
                beam.text = decode(beam.token_ids)
    return results
