"""Speculative decoding with the ngram proposer gives the outputs decoding one token at a time gives: greedy
tokens, seeded sampling with n > 1, stop strings, max_tokens, structured output, requests joining mid-decode,
a shared prompt prefix and a cache small enough to preempt; unseeded sampling draws from the same
distribution (a chi-square test); a failing proposer costs only its speedup."""

from __future__ import annotations

import math

import pytest
from scipy.stats import chi2_contingency

from pluginfer import StructuredOutputsParams
from pluginfer.core.config import ConfigError
from pluginfer.core.speculative import DraftRequest
from pluginfer.engine.engine import LLMEngine
from pluginfer.engine.sequence import SamplingParams
from pluginfer.speculative.ngram import NgramProposer
from tests.engine.staggered import run_staggered
from tests.server.conftest import server_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
LOOP = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]  # a prompt that repeats itself: the lookup finds drafts at once
# (step at which it joins, prompt, params)
REQUESTS = {
    "greedy": (0, LOOP, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)),
    "n3": (0, [20, 21, 22, 20, 21], SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=14, logprobs=2)),
    "stop": (3, [40, 41, 42], SamplingParams(temperature=1.0, seed=3, max_tokens=24, stop=["a", "e", " "])),
    "late": (9, [50, 51, 52, 53, 54], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    "shared": (10, LOOP + [7], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    "short": (12, [60, 61], SamplingParams(n=2, temperature=0.0, max_tokens=2, ignore_eos=True)),
    "regex": (2, [30, 31, 30], SamplingParams(temperature=0.8, seed=9, max_tokens=16,
                                              structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){2,6}"))),
    "long": (15, list(range(70, 90)), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
}


@pytest.fixture
def checkpoint(tiny_llama_checkpoint: tuple) -> object:
    return tiny_llama_checkpoint[0]


def _run(checkpoint: object, speculative: dict | None, blocks: int = 24) -> tuple[dict, LLMEngine]:
    engine = LLMEngine(server_config(checkpoint, **{"scheduler.max_num_seqs": 8, "cache.num_blocks": blocks,
                                                    "cache.block_size": 4, "max_model_len": 64,
                                                    "speculative_config": speculative}))
    return run_staggered(engine, REQUESTS)[0], engine


def _same_logprobs(ours: list | None, theirs: list | None) -> bool:
    """Equal top ids, values within float32 rounding: a draft's logits come from a multi-token pass, whose
    matmul shapes differ from a decode's."""
    if ours is None or theirs is None:
        return ours is theirs
    return all(a.keys() == b.keys() and all(math.isclose(a[t], b[t], abs_tol=1e-4) for t in a)
               for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("blocks", [24, 12])  # 12: small enough that sequences are preempted and recomputed
def test_speculative_outputs_equal_one_token_at_a_time(checkpoint, blocks: int) -> None:
    plain, plain_engine = _run(checkpoint, None, blocks)
    spec, engine = _run(checkpoint, NGRAM, blocks)
    assert spec.keys() == plain.keys() == REQUESTS.keys()
    for request_id in REQUESTS:
        for ours, theirs in zip(spec[request_id], plain[request_id], strict=True):
            assert ours[:3] == theirs[:3] and ours[4] == theirs[4], request_id
            assert _same_logprobs(ours[3], theirs[3]), request_id
    stats = engine.stats()
    assert stats.spec_drafts > 0 and 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert stats.num_preemptions == plain_engine.stats().num_preemptions or blocks == 12
    if blocks == 12:
        assert stats.num_preemptions > 0


def test_unseeded_sampling_draws_from_the_same_distribution(checkpoint, monkeypatch) -> None:
    """The first three tokens of 300 unseeded samples, the proposer drafting the greedy continuation (taken
    often, not always): the counts at each position with and without speculation are one distribution
    (chi-square test of homogeneity; the engine's seed makes the run repeatable)."""
    prompt = [5, 6, 7]
    greedy_engine = LLMEngine(server_config(checkpoint))
    try:
        greedy_engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "g")
        outputs = []
        while greedy_engine.has_unfinished_requests():
            outputs += greedy_engine.step()
        continuation = outputs[-1].outputs[0].token_ids
    finally:
        greedy_engine.shutdown()
    monkeypatch.setattr(NgramProposer, "propose", lambda self, requests: [
        continuation[len(r.token_ids) - len(prompt):][:r.max_tokens] for r in requests])
    counts = []
    for speculative in (None, NGRAM):
        engine = LLMEngine(server_config(checkpoint, **{"scheduler.max_num_seqs": 64, "seed": 1,
                                                        "speculative_config": speculative}))
        try:
            params = SamplingParams(temperature=0.3, max_tokens=4, ignore_eos=True)
            for index in range(300):
                engine.add_request(prompt, params, f"r{index}")
            tokens = []
            while engine.has_unfinished_requests():
                tokens += [o.outputs[0].token_ids for o in engine.step() if o.finished]
            counts.append(tokens)
            if speculative:
                stats = engine.stats()
                assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # both paths taken
        finally:
            engine.shutdown()
    for position in (1, 2, 3):
        seen = sorted({t[position] for run in counts for t in run})
        table = [[sum(t[position] == token for t in run) for token in seen] for run in counts]
        kept = [i for i in range(len(seen)) if table[0][i] + table[1][i] >= 10]  # the test's cells need mass
        rest = [sum(row) - sum(row[i] for i in kept) for row in table]
        table = [[row[i] for i in kept] + ([r] if any(rest) else []) for row, r in zip(table, rest)]
        assert len(table[0]) >= 2, table  # several outcomes, or the test says nothing
        assert chi2_contingency(table).pvalue > 1e-3, (position, table)


def test_the_ngram_lookup_drafts_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(lookup_min=1, lookup_max=3)
    requests = [DraftRequest(0, [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 3),  # latest match of [1, 2, 3]
                DraftRequest(1, [4, 5, 6, 7, 5], 2),  # no 3- or 2-gram: the 1-gram [5]
                DraftRequest(2, [1, 2, 3, 4], 4),  # nothing before repeats
                DraftRequest(3, [7, 7, 7], 5)]  # the match may run into the suffix: [7, 7] then 7
    assert proposer.propose(requests) == [[8, 5, 1], [6, 7], [], [7]]


def test_a_failing_proposer_costs_only_its_speedup(checkpoint, monkeypatch, caplog) -> None:
    plain, _ = _run(checkpoint, None)
    calls = {"n": 0}

    def broken(self, requests):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("lookup table lost")
        return [[10**9] for _ in requests]  # not a token id

    monkeypatch.setattr(NgramProposer, "propose", broken)
    spec, engine = _run(checkpoint, NGRAM)
    assert {k: [c[:3] for c in v] for k, v in spec.items()} == {k: [c[:3] for c in v] for k, v in plain.items()}
    assert calls["n"] > 2 and engine.stats().spec_drafts == 0
    assert "speculative proposer NgramProposer failed" in caplog.text
    assert "drafted something other than token ids" in caplog.text


def test_bad_speculative_configs_name_the_field(checkpoint) -> None:
    with pytest.raises(ConfigError, match="speculative_config.num_speculative_tokens"):
        server_config(checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="prompt_lookup_min .* is above prompt_lookup_max"):
        server_config(checkpoint, speculative_config={"num_speculative_tokens": 2,
                                                                 "prompt_lookup_min": 5, "prompt_lookup_max": 3})
    with pytest.raises(Exception, match="ngramm.*ngram"):
        LLMEngine(server_config(checkpoint, speculative_config={"method": "ngramm",
                                                                           "num_speculative_tokens": 2}))


def test_a_draft_model_drafts_and_the_output_stays(checkpoint, tmp_path) -> None:
    """The target itself as its draft model: its greedy drafts are the target's own tokens (up to the
    rounding of a different batch shape), so nearly all are taken; the outputs stay those of plain decoding."""
    draft = {"model": str(checkpoint), "num_speculative_tokens": 3}
    plain, _ = _run(checkpoint, None)
    spec, engine = _run(checkpoint, draft)
    assert {k: [c[:3] for c in v] for k, v in spec.items()} == {k: [c[:3] for c in v] for k, v in plain.items()}
    stats = engine.stats()
    assert stats.spec_draft_tokens > 20 and stats.spec_accepted_tokens > 0


def test_a_draft_model_with_another_vocabulary_is_refused(checkpoint, tmp_path) -> None:
    from pluginfer.demo.tokenizer import train_tokenizer
    from tests.checkpoints import save_hf_model
    from tests.conftest import TINY_LLAMA

    other = save_hf_model("LlamaForCausalLM", TINY_LLAMA, tmp_path / "other", train_tokenizer(tmp_path / "tok", 1500))
    assert other is not None
    with pytest.raises(ValueError, match=r"speculative_config.model .*other: its tokenizer's vocabulary is not"):
        LLMEngine(server_config(checkpoint, speculative_config={"model": str(tmp_path / "other"),
                                                                "num_speculative_tokens": 2}))
    with pytest.raises(ConfigError, match="method draft_model needs model"):
        server_config(checkpoint, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
