"""Sampler: masks on toy logits, sampling frequencies, seeds, penalties by their definitions, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pluginfer.engine.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p, greedy_argmax
from pluginfer.engine.sequence import SamplingParams, Sequence

EOS = 0
# probabilities 0.5, 0.3, 0.15, 0.05 (no top-p boundary falls on a float tie)
TOY_LOGITS = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def seq(prompt=(5, 6), output=(), index=0, request_id="r", **params) -> Sequence:
    s = Sequence(request_id, list(prompt), SamplingParams(**params), index=index)
    s.output_token_ids = list(output)
    return s


def sampled_set(logits: torch.Tensor, draws: int = 2000, **params) -> set[int]:
    """Which tokens a row with ``params`` can produce: one call, ``draws`` identical rows."""
    seqs = [seq(**params) for _ in range(draws)]
    return set(Sampler(logits.shape[-1], {EOS})(logits.expand(draws, -1).clone(), seqs).token_ids)


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row.isfinite()).flatten().tolist()) for row in masked]


def test_top_k_mask():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 5.0, 3.0, 4.0, 2.0]])
    assert kept(apply_top_k_top_p(logits, torch.tensor([2, 0]), None)) == [{1, 3}, {0, 1, 2, 3, 4}]
    assert sampled_set(logits[0], top_k=2) == {1, 3}
    assert sampled_set(logits[0], top_k=1) == {1}


@pytest.mark.parametrize(("top_p", "expected"), [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
    logits = TOY_LOGITS[torch.tensor([2, 0, 3, 1])]  # shuffled: 0.15, 0.5, 0.05, 0.3
    order = [1, 3, 0, 2]  # position in the shuffled row of probability rank 0, 1, 2, 3
    expected_positions = {order[rank] for rank in expected}
    assert kept(apply_top_k_top_p(logits[None], None, torch.tensor([top_p]))) == [expected_positions]
    assert sampled_set(logits, top_p=top_p) == expected_positions


def test_top_k_then_top_p_renormalises():
    # top-k 3 leaves 0.5, 0.3, 0.15, renormalised 0.526, 0.316, 0.158: p = 0.83 keeps two
    # (without renormalising, 0.5 + 0.3 < 0.83 would keep three).
    masked = apply_top_k_top_p(TOY_LOGITS[None], torch.tensor([3]), torch.tensor([0.83]))
    assert kept(masked) == [{0, 1}]
    assert sampled_set(TOY_LOGITS, top_k=3, top_p=0.83) == {0, 1}


def test_top_p_candidate_shortcut_equals_full_sort():
    torch.manual_seed(0)
    logits = torch.randn(8, 500) * torch.tensor([0.5, 1, 2, 4, 8, 8, 16, 1]).unsqueeze(1)
    top_k = torch.tensor([0, 0, 10, 0, 3, 0, 0, 50])
    top_p = torch.tensor([0.9, 0.5, 0.9, 0.95, 1.0, 1.0, 0.7, 0.99])
    full = apply_top_k_top_p(logits, top_k, top_p, candidates=500)
    for candidates in (1, 16, 64):
        assert kept(apply_top_k_top_p(logits, top_k, top_p, candidates=candidates)) == kept(full)
    probs = logits.softmax(-1)
    for row, keep in enumerate(kept(full)):  # smallest set: dropping its least likely token falls below p
        if top_k[row] == 0 and top_p[row] < 1:
            mass = sorted(probs[row, list(keep)].tolist(), reverse=True)
            assert sum(mass) >= top_p[row] - 1e-6 and sum(mass[:-1]) < top_p[row]


@pytest.mark.parametrize(("min_p", "expected"), [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p(min_p, expected):
    assert kept(apply_min_p(TOY_LOGITS[None], torch.tensor([min_p]))) == [expected]
    assert sampled_set(TOY_LOGITS, min_p=min_p) == expected


def test_sampling_frequencies_follow_softmax_with_temperature():
    draws = 20000
    seqs = [seq(temperature=0.5) for _ in range(draws)]
    tokens = Sampler(4, {EOS})(TOY_LOGITS.expand(draws, -1).clone(), seqs).token_ids
    counts = Counter(tokens)
    expected = torch.softmax(TOY_LOGITS / 0.5, -1)
    for token in range(4):
        assert abs(counts[token] / draws - expected[token].item()) < 0.015


def test_greedy_is_argmax_and_mixes_with_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 100)
    seqs = [seq(temperature=0.0) if i % 2 == 0 else seq(temperature=1.0, top_k=5) for i in range(6)]
    out = Sampler(100, {EOS})(logits, seqs).token_ids
    argmax = logits.argmax(-1).tolist()
    assert out[0::2] == argmax[0::2]
    for i in (1, 3, 5):
        assert out[i] in logits[i].topk(5).indices.tolist()


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(500, 8)
    logits[:, 5:] = 100.0  # columns past the real vocabulary of 5
    out = Sampler(5, {EOS})(logits, [seq() for _ in range(500)]).token_ids
    assert max(out) < 5


def test_all_greedy_batch_is_the_argmax_of_the_real_vocabulary():
    # The sampler's shortcut for a batch of plain greedy rows: the argmax, padding columns excluded.
    torch.manual_seed(2)
    logits = torch.randn(5, 40)
    logits[:, 32:] = 100.0  # columns past the real vocabulary of 32
    out = Sampler(32, {EOS})(logits, [seq(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits[:, :32].argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_greedy_argmax_equals_torch_argmax_with_ties_nan_and_padding():
    torch.manual_seed(3)
    logits = torch.randn(6, 50)
    logits[1, 7] = logits[1, 30] = 50.0  # a tie: the first index
    logits[2, 9] = logits[2, 20] = float("nan")  # NaN counts as the maximum, the first one
    logits[3] = float("-inf")
    logits[4, 3] = float("inf")
    view = logits[:, :40]  # a strided view, as the sampler's cut of a padded vocabulary
    for rows in (logits, view, logits[:0]):
        assert torch.equal(greedy_argmax(rows), rows.argmax(dim=-1))
        assert greedy_argmax(rows, as_list=True) == rows.argmax(dim=-1).tolist()  # the decode step's list
    assert greedy_argmax(view).tolist()[1:5] == [7, 9, 0, 3]


@pytest.mark.parametrize("params", [dict(logit_bias={4: 100.0}), dict(min_tokens=3, stop_token_ids=[7]),
                                    dict(repetition_penalty=100.0), dict(logprobs=0)])
def test_one_row_with_more_than_greedy_is_not_a_plain_argmax(params):
    # Rows that ask for a bias, a min_tokens mask, a penalty or logprobs keep their effect beside plain rows.
    logits = torch.zeros(2, 10)
    logits[:, 7], logits[:, 4] = 5.0, 4.0
    seqs = [seq(prompt=(7,), temperature=0.0), seq(prompt=(7,), temperature=0.0, **params)]
    out = Sampler(10, {EOS})(logits, seqs)
    assert out.token_ids[0] == 7
    if "logprobs" in params:
        assert out.token_ids[1] == 7 and out.logprobs[1][7] == pytest.approx(torch.log_softmax(logits[1], -1)[7].item())
    else:
        assert out.token_ids[1] == 4  # 4 raised by the bias, or 7 banned by min_tokens or penalised as a prompt token


def run_steps(sampler: Sampler, seqs: list[Sequence], logits: torch.Tensor, steps: int, row: int = 0) -> list[int]:
    """Sample ``steps`` tokens for ``seqs[row]`` (appending each, as the engine does)."""
    tokens = []
    for _ in range(steps):
        token = sampler(logits, seqs).token_ids[row]
        seqs[row].output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seed_reproducible_across_samplers_and_batch_companions():
    torch.manual_seed(2)
    logits = torch.randn(1, 1000)
    alone = run_steps(Sampler(1000, {EOS}), [seq(seed=1234)], logits, 20)
    again = run_steps(Sampler(1000, {EOS}), [seq(seed=1234)], logits, 20)
    companions = [seq(temperature=0.3, top_k=7), seq(temperature=0.0), seq(seed=1234), seq(top_p=0.5)]
    batch_logits = torch.cat([torch.randn(1, 1000), torch.randn(1, 1000), logits, torch.randn(1, 1000)])
    in_batch = run_steps(Sampler(1000, {EOS}), companions, batch_logits, 20, row=2)
    other_seed = run_steps(Sampler(1000, {EOS}), [seq(seed=4321)], logits, 20)
    assert alone == again == in_batch
    assert alone != other_seed


def test_sampler_seed_makes_unseeded_rows_reproducible():
    logits = torch.zeros(8, 1000)
    runs = [Sampler(1000, {EOS}, seed=3)(logits, [seq() for _ in range(8)]).token_ids for _ in range(2)]
    assert runs[0] == runs[1] != Sampler(1000, {EOS}, seed=4)(logits, [seq() for _ in range(8)]).token_ids


def test_n_choices_of_one_seeded_request_differ_but_reproduce():
    logits = torch.zeros(4, 1000)  # uniform: equal tokens by chance are unlikely

    def choices() -> list[list[int]]:
        seqs = [seq(seed=7, index=i) for i in range(4)]
        sampler = Sampler(1000, {EOS})
        rows = [sampler(logits, seqs).token_ids for _ in range(10)]
        return [list(column) for column in zip(*rows, strict=True)]

    first = choices()
    assert len({tuple(c) for c in first}) == 4
    assert choices() == first


def test_repetition_penalty_matches_hf_definition():
    torch.manual_seed(3)
    logits = torch.randn(3, 12)
    seqs = [seq(prompt=[1, 2, 2], output=[3, 7], repetition_penalty=1.3),
            seq(prompt=[4], output=[4, 5], repetition_penalty=0.8),
            seq(prompt=[1, 2], output=[3])]
    expected = logits.clone()
    for row, s in enumerate(seqs):
        for token in set(s.prompt_token_ids + s.output_token_ids):
            value, p = logits[row, token].item(), s.params.repetition_penalty
            expected[row, token] = value / p if value > 0 else value * p
    torch.testing.assert_close(apply_penalties(logits, seqs), expected)


def test_frequency_and_presence_penalties_match_openai_definition():
    torch.manual_seed(4)
    logits = torch.randn(2, 10)
    seqs = [seq(prompt=[1, 1, 9], output=[2, 2, 2, 5], frequency_penalty=0.5, presence_penalty=0.25),
            seq(prompt=[2], output=[3, 3], presence_penalty=-1.0)]
    expected = logits.clone()
    for row, s in enumerate(seqs):
        for token, count in Counter(s.output_token_ids).items():  # prompt tokens are not penalised
            expected[row, token] -= s.params.frequency_penalty * count + s.params.presence_penalty
    torch.testing.assert_close(apply_penalties(logits, seqs), expected)


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0], [-1.0, -1.05, -5.0, -5.0]])
    seqs = [seq(prompt=[0], temperature=0.0, repetition_penalty=1.1),
            seq(prompt=[0], temperature=0.0, repetition_penalty=1.1)]
    assert Sampler(4, {EOS})(logits, seqs).token_ids == [1, 1]
    plain = [seq(prompt=[0], temperature=0.0), seq(prompt=[0], temperature=0.0)]
    assert Sampler(4, {EOS})(logits, plain).token_ids == [0, 0]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[10.0, 9.0, 8.0, 0.0]]).expand(4, -1).clone()
    sampler = Sampler(4, {EOS})
    seqs = [seq(output=[3], temperature=0.0, min_tokens=2),  # EOS masked
            seq(output=[3], temperature=0.0, min_tokens=2, stop_token_ids=[1]),  # EOS and 1 masked
            seq(output=[3], temperature=0.0, min_tokens=2, ignore_eos=True),  # EOS allowed
            seq(output=[3, 3], temperature=0.0, min_tokens=2)]  # min_tokens reached
    assert sampler(logits, seqs).token_ids == [1, 2, 0, 0]
    never_eos = sampled_set(logits[0], output=[3], min_tokens=2, temperature=5.0)
    assert EOS not in never_eos and len(never_eos) == 3


def test_logprobs_are_raw_log_softmax_with_sampled_and_top_alternatives():
    torch.manual_seed(5)
    logits = torch.randn(3, 50)
    seqs = [seq(logprobs=3, temperature=0.7, repetition_penalty=1.5, top_k=20),
            seq(logprobs=0, temperature=0.0),
            seq()]
    out = Sampler(50, {EOS})(logits, seqs)
    reference = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    top3 = reference[0].topk(3).indices.tolist()
    assert set(first) == set(top3) | {out.token_ids[0]}
    for token, value in first.items():
        assert math.isclose(value, reference[0, token].item(), rel_tol=1e-5, abs_tol=1e-6)
    assert out.logprobs[1] == pytest.approx({out.token_ids[1]: reference[1, out.token_ids[1]].item()})
    assert out.logprobs[2] is None


def test_logit_bias_is_added_to_its_row_only():
    logits = torch.zeros(2, 8)
    logits[:, 3] = 5.0
    biased = seq(temperature=0.0, logit_bias={6: 100.0, 3: -100.0})
    plain = seq(temperature=0.0, request_id="other")
    out = Sampler(8, set())(logits, [biased, plain])
    assert out.token_ids == [6, 3]


def test_out_of_range_sampling_values_are_rejected_or_made_greedy():
    assert SamplingParams(temperature=1e-30).temperature == 0.0  # would overflow float32 logits
    for field, value in (("repetition_penalty", 1e-30), ("top_k", 2**40), ("temperature", float("nan")),
                         ("logit_bias", {3: 1000.0})):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**{field: value})


class NoHostReads:
    """Fails any read of a tensor's value back to the host (``bool(t)``, ``int(t)``, ``t.item()``: the
    device syncs of a GPU step) while it is active; ``tolist`` of the sampled ids stays allowed."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    raise AssertionError("a host read of a tensor value (a device sync)")
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def test_sync_free_top_k_top_p_keeps_the_same_tokens_without_host_reads():
    """The device path (a full sort, no data-dependent width) equals the CPU shortcut, and reads nothing
    back; the shortcut itself does read (so the check can see a read)."""
    torch.manual_seed(0)
    logits = torch.randn(8, 500) * torch.tensor([0.5, 1, 2, 4, 8, 8, 16, 1]).unsqueeze(1)
    top_k = torch.tensor([0, 0, 10, 0, 3, 0, 0, 50])
    top_p = torch.tensor([0.9, 0.5, 0.9, 0.95, 1.0, 1.0, 0.7, 0.99])
    for k, p in ((top_k, top_p), (top_k, None), (None, top_p), (torch.zeros(8, dtype=torch.long), None)):
        with NoHostReads():
            free = apply_top_k_top_p(logits, k, p, candidates=16, sync_free=True)
        assert kept(free) == kept(apply_top_k_top_p(logits, k, p, candidates=16, sync_free=False))
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        apply_top_k_top_p(logits, top_k, top_p, candidates=16, sync_free=False)


def test_a_sync_free_sampler_reads_back_only_the_sampled_ids():
    """A batch with every processor (temperature, top-k, top-p, min-p, penalties, bias, min_tokens, seeds,
    greedy rows) samples with no host read but the ids' ``tolist``, as on a GPU, and keeps the tokens the
    CPU path's seeded draws give."""
    torch.manual_seed(3)
    logits = torch.randn(6, 300)

    def batch():
        return [seq(temperature=0.7, top_k=20, seed=1), seq(temperature=1.0, top_p=0.8, seed=2),
                seq(temperature=0.9, min_p=0.05, seed=3, output=(7, 7, 9), repetition_penalty=1.3),
                seq(temperature=0.0), seq(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.2, seed=4,
                                          output=(1, 2)),
                seq(temperature=1.0, top_k=5, top_p=0.9, seed=5, logit_bias={3: 2.0}, min_tokens=4)]

    device_like = Sampler(300, {EOS}, seed=0)
    device_like.sync_free = True
    with NoHostReads():
        free = device_like(logits.clone(), batch()).token_ids
    assert free == Sampler(300, {EOS}, seed=0)(logits.clone(), batch()).token_ids


def test_sequences_found_plain_greedy_are_remembered_when_said_the_same_and_others_checked() -> None:
    """The sampler remembers whether the last call's sequences were all plain greedy, for a call that says it
    has the same ones (``same_seqs``: the engine's steady decode): a row masked by min_tokens is sampled with
    its mask until it has its tokens, even when said the same, then by the plain argmax, the same sequences
    again by the argmax of the new logits, and new sequences with a row that asks for logprobs by the general
    path."""
    sampler = Sampler(4, {EOS})
    eos_first = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    waiting = seq(temperature=0.0, min_tokens=1)
    seqs = [waiting]
    assert sampler(eos_first, seqs).token_ids == [1]  # EOS masked: fewer outputs than min_tokens
    assert sampler(eos_first, seqs, same_seqs=True).token_ids == [1]  # not plain last time: still checked
    waiting.output_token_ids.append(1)
    assert sampler(eos_first, seqs, same_seqs=True).token_ids == [0]  # now plain greedy
    assert sampler(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), seqs, same_seqs=True).token_ids == [3]  # remembered
    replayed = torch.tensor([[0.0, 1.0, 2.0, 3.0]])  # a replay's output, written over every step
    assert sampler(replayed, seqs, same_seqs=True).token_ids == [3]
    replayed[0, 1] = 9.0
    assert sampler(replayed, seqs, same_seqs=True).token_ids == [1]  # the kept numpy view sees the new values
    padded = torch.tensor([[0.0, 1.0, 2.0, 3.0, 7.0]])  # a padded vocabulary: its extra column is not a token
    assert sampler(padded, seqs).token_ids == [3]
    with_logprobs = [waiting, seq(temperature=0.0, logprobs=1)]
    out = sampler(torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]]), with_logprobs)
    assert out.token_ids == [3, 0] and out.logprobs[0] is None and set(out.logprobs[1]) == {0}
