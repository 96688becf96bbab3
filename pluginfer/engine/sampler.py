"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded generators, logprobs.

The order and definitions follow vLLM: logprobs come from the raw logits; then repetition,
frequency and presence penalties; the min_tokens mask; greedy rows take the argmax; other
rows are divided by their temperature, cut by top-k, top-p and min-p, and sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pluginfer.engine.sequence import SamplingParams, Sequence
from pluginfer.engine.structured import fill_token_bitmask

_MASK_64 = 2**64 - 1
# odd multiplier (splitmix64) so (seed, index) pairs rarely collide
_GOLDEN_64 = 0x9E3779B97F4A7C15


@dataclass
class SamplerOutput:
    """The chosen token of each row and, where asked for, its logprob and the top alternatives."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (HF: over prompt and output) then frequency and presence (OpenAI: over output) penalties."""
    params = [seq.params for seq in seqs]
    device, vocab_size = logits.device, logits.shape[1]
    if any(p.repetition_penalty != 1.0 for p in params):
        used = [p.repetition_penalty != 1.0 for p in params]
        ids = _padded_ids([s.token_ids if u else [] for s, u in zip(seqs, used, strict=True)], vocab_size, device)
        seen = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.bool, device=device)
        seen = seen.scatter_(1, ids, True)[:, :vocab_size]
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        used = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
        ids = _padded_ids([s.output_token_ids if u else [] for s, u in zip(seqs, used, strict=True)], vocab_size, device)
        counts = torch.zeros(len(seqs), vocab_size + 1, device=device)
        counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :vocab_size]
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
    """While a sequence has fewer than min_tokens outputs, mask its EOS (unless ignore_eos) and stop ids."""
    rows: list[int] = []
    banned: list[int] = []
    for i, seq in enumerate(seqs):
        params = seq.params
        if len(seq.output_token_ids) >= params.min_tokens:
            continue
        tokens = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        tokens = [t for t in tokens if 0 <= t < logits.shape[1]]
        rows += [i] * len(tokens)
        banned += tokens
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(banned, device=logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, candidates: int = 256,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """Set to -inf what top-k (0 = off) and then top-p (1 = off) drop; the top token always stays.

    Top-p keeps the smallest prefix of the sorted distribution whose mass reaches p. Only the
    ``candidates`` largest logits are sorted (a full sort of a 32k vocabulary costs ms on a
    CPU), unless a row's top-p set reaches past them; ties with the last kept logit are kept.

    ``sync_free`` (default: the logits are not on the CPU) reads nothing back to the host: the shortcut,
    whose width depends on the data, gives way to one full sort (cheap on a GPU), so that a device's step
    waits for the host only to read the sampled ids. Both ways keep the same tokens.
    """
    if sync_free is None:
        sync_free = logits.device.type != "cpu"
    if top_k is None and top_p is None:
        return logits
    batch, vocab_size = logits.shape
    k = top_k.clamp(max=vocab_size) if top_k is not None else torch.zeros(batch, dtype=torch.long, device=logits.device)
    k_off = (k == 0).unsqueeze(1)
    if top_p is None:
        if sync_free:
            values = logits.sort(dim=-1, descending=True).values
        elif not bool(k.any()):
            return logits
        else:
            values = logits.topk(int(k.max()), dim=-1).values
        kth = values.gather(1, (k.clamp(min=1) - 1).unsqueeze(1)).masked_fill(k_off, float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    p = top_p.to(torch.float32).unsqueeze(1)
    p_off = p >= 1
    probs = logits.softmax(dim=-1)
    # Rows with top-k need only their top k; a top-p row without top-k may need more.
    if sync_free:
        width = vocab_size
    else:
        needs_candidates = bool((k_off & ~p_off).any())
        width = min(vocab_size, max(candidates if needs_candidates else 1, int(k.max())))
    while True:
        values, order = logits.topk(width, dim=-1)
        kth = values.gather(1, (k.clamp(min=1) - 1).unsqueeze(1)).masked_fill(k_off, float("-inf"))
        in_top_k = values >= kth
        kept_probs = probs.gather(1, order) * in_top_k
        # Top-k rows renormalise over their top k, which all lie among the candidates.
        kept_probs = kept_probs / torch.where(k_off, 1.0, kept_probs.sum(dim=-1, keepdim=True))
        mass_before = kept_probs.cumsum(dim=-1) - kept_probs
        keep = in_top_k & ((mass_before < p) | p_off)
        keep[:, 0] = True
        reaches_past = keep[:, -1:] & k_off & ~p_off
        if width == vocab_size or not bool(reaches_past.any()):
            break
        width = vocab_size
    threshold = values.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    threshold = threshold.masked_fill(k_off & p_off, float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's largest probability."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def derive_seed(seed: int, index: int) -> int:
    """Seed of choice ``index`` of a request seeded with ``seed`` (distinct per choice, reproducible)."""
    return (seed * _GOLDEN_64 + index) & _MASK_64


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Add each row's ``logit_bias`` (ids past the vocabulary are an error for that request only upstream)."""
    rows = [(i, seq.params.logit_bias) for i, seq in enumerate(seqs) if seq.params.logit_bias]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for row, bias in rows:  # only rows that ask for it; each touches a handful of ids
        ids = torch.tensor([t for t in bias if t < vocab], dtype=torch.long, device=logits.device)
        values = torch.tensor([b for t, b in bias.items() if t < vocab], dtype=logits.dtype, device=logits.device)
        logits[row, ids] += values
    return logits


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Set to -inf the tokens each structured-output sequence's grammar forbids next (one batched mask)."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return logits
    forbidden = fill_token_bitmask([seqs[i].grammar for i in rows], logits.shape[1], forbidden=True)
    forbidden = forbidden.to(logits.device)
    if len(rows) == len(seqs):
        return logits.masked_fill(forbidden, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    return logits.index_copy(0, index, logits[index].masked_fill(forbidden, float("-inf")))


class Sampler:
    """Picks one token per row of a logits batch, each row following its sequence's SamplingParams."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int], seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.seed = seed  # for rows without their own seed; None: nondeterministic
        self._generators: dict[torch.device, torch.Generator] = {}
        # None: decided by the logits' device (no host reads but the sampled ids off the CPU; tests set it)
        self.sync_free: bool | None = None
        # The last call's sequences were all plain greedy: a sequence that is stays so (its params and grammar
        # are fixed, its outputs only grow past min_tokens), so a call with the same sequences need not check.
        self._last_plain = False
        self._greedy_view: tuple[torch.Tensor | None, np.ndarray | None] = (None, None)  # (logits, their numpy view)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], same_seqs: bool = False) -> SamplerOutput:
        """Sample a token for each ``seqs[i]`` from ``logits[i]``. ``same_seqs``: these are the last call's
        sequences, in order (the engine says so when a step repeats the last step's rows)."""
        assert logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        if (same_seqs and self._last_plain) or all(map(_plain_greedy, seqs)):  # nothing but an argmax to do
            self._last_plain = True
            token_ids = self._greedy_ids(logits)
            return SamplerOutput(token_ids=token_ids, logprobs=[None] * len(token_ids))
        self._last_plain = False
        logits = logits[:, : self.vocab_size].float()  # models may pad the vocabulary
        params = [seq.params for seq in seqs]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None

        logits = apply_penalties(logits, seqs)
        logits = apply_logit_bias(logits, seqs)
        logits = apply_min_tokens(logits, seqs, self.eos_token_ids)
        logits = apply_grammar_masks(logits, seqs)

        greedy = [p.temperature == 0 for p in params]
        if all(greedy):
            token_ids = greedy_argmax(logits)
        else:
            sampled = self._sample(logits, seqs, params)
            if any(greedy):
                greedy_mask = torch.tensor(greedy, device=logits.device)
                sampled = torch.where(greedy_mask, greedy_argmax(logits), sampled)
            token_ids = sampled

        token_list = token_ids.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, logprob_rows, token_ids, params, logprobs)
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    def _greedy_ids(self, logits: torch.Tensor) -> list[int]:
        """``greedy_argmax`` of the vocabulary's columns as a list. A decode replay hands the same logits tensor
        every step (written over): its numpy view is kept, as making it right after the replay is slow (the
        tensor's C++ state is out of the caches)."""
        seen, array = self._greedy_view
        if logits is not seen:
            columns = logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size]
            if not (columns.device.type == "cpu" and columns.dtype == torch.float32 and not columns.requires_grad):
                return greedy_argmax(columns, as_list=True)
            array = columns.numpy()
            self._greedy_view = (logits, array)
        return array.argmax(axis=-1).tolist()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temperatures = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        if any(t != temperatures[0] for t in temperatures):
            logits = logits / torch.tensor(temperatures, device=device).unsqueeze(1)
        elif temperatures[0] != 1.0:
            logits = logits / temperatures[0]

        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p, sync_free=self.sync_free)
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))

        # Inverse CDF, one uniform per row: cheaper on a CPU than elementwise exp/log over the vocabulary
        # (exponential race, torch.multinomial).
        # float64 so that tokens far below float32's resolution near 1 keep their share.
        cdf = logits.softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1:]
        uniform = torch.rand(len(seqs), 1, dtype=torch.float64, device=device, generator=self._default_generator(device))
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                generator = _sequence_generator(seq, device)
                uniform[i] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)
        # x < total strictly, so the chosen index has cdf[i] > cdf[i - 1]: a token of nonzero probability.
        x = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, x, right=True).squeeze(1)

    def _default_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed & _MASK_64)
            self._generators[device] = generator
        return generator

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor,
        rows: list[int],
        token_ids: torch.Tensor,
        params: list[SamplingParams],
        out: list[dict[int, float] | None],
    ) -> None:
        row_index = torch.tensor(rows, device=raw_logprobs.device)
        chosen = token_ids[row_index]
        chosen_logprobs = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        max_alternatives = max(params[i].logprobs for i in rows)
        top_values = top_ids = None
        if max_alternatives > 0:
            top = raw_logprobs.topk(min(max_alternatives, raw_logprobs.shape[1]), dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for j, (i, token, logprob) in enumerate(zip(rows, chosen.tolist(), chosen_logprobs, strict=True)):
            entry = {token: logprob}
            if top_ids is not None:
                count = params[i].logprobs
                for alternative, value in zip(top_ids[j][:count], top_values[j][:count], strict=True):
                    entry.setdefault(alternative, value)
            out[i] = entry


def greedy_argmax(logits: torch.Tensor, as_list: bool = False) -> torch.Tensor | list[int]:
    """``logits.argmax(dim=-1)`` (int64; the first index of a row's maximum, a NaN counting as the maximum);
    ``as_list``: as a list of ints (what a decode step appends; no tensor made on the CPU).

    On the CPU numpy's vectorised argmax gives the same indices an order of magnitude faster than torch's.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        indices = logits.numpy().argmax(axis=-1)
        return indices.tolist() if as_list else torch.from_numpy(indices.astype(np.int64, copy=False))
    indices = logits.argmax(dim=-1)
    return indices.tolist() if as_list else indices


def _plain_greedy(seq: Sequence) -> bool:
    """Whether the sequence's next token is the argmax of its raw logits: greedy, no logprobs, and no
    penalty, bias, min_tokens mask or grammar that would change a logit."""
    params = seq.params
    return (params.temperature == 0 and params.logprobs is None and not params.logit_bias
            and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and seq.grammar is None
            and len(seq.output_token_ids) >= params.min_tokens)


def _padded_ids(token_lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[B, longest] int64, padded with ``pad`` (an extra column the caller drops); ids >= pad also go there."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    ids = torch.tensor([tokens + [pad] * (width - len(tokens)) for tokens in token_lists], dtype=torch.long)
    ids = ids.reshape(len(token_lists), width).clamp_(0, pad)
    return ids.to(device)


def _sequence_generator(seq: Sequence, device: torch.device) -> torch.Generator:
    """The sequence's own generator, created on first use from (seed, index)."""
    generator = seq.generator
    if not isinstance(generator, torch.Generator) or generator.device != device:
        generator = torch.Generator(device=device)
        generator.manual_seed(derive_seed(seq.params.seed, seq.index))
        seq.generator = generator
    return generator
