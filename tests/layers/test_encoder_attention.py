"""EncoderAttention against attention written out per sequence (softmax of q k^T over the sequence's own keys,
no causal mask): sequences of different lengths in one flat batch must not see each other."""

from __future__ import annotations

import pytest
import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.layers.encoder_attention import EncoderAttention

HEADS, HEAD_DIM = 3, 8


def flat_batch(lens: list[int], computed: list[int] | None = None) -> ForwardBatch:
    computed = computed or [0] * len(lens)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, lens)])
    seq_lens = torch.tensor([c + n for c, n in zip(computed, lens)])
    return ForwardBatch(input_ids=torch.zeros(sum(lens), dtype=torch.long), positions=positions,
                        slot_mapping=torch.zeros(sum(lens), dtype=torch.long), query_start_loc=starts,
                        seq_lens=seq_lens, block_tables=torch.zeros(len(lens), 1, dtype=torch.long),
                        logits_indices=torch.arange(sum(lens)), query_lens=lens, max_query_len=max(lens),
                        max_seq_len=int(seq_lens.max()), block_size=16)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
              window: int | None = None) -> torch.Tensor:
    outs, at = [], 0
    for n in lens:
        qs, ks, vs = (x[at:at + n].transpose(0, 1) for x in (q, k, v))  # [heads, n, dim]
        scores = qs @ ks.transpose(1, 2) / HEAD_DIM**0.5
        if window is not None:
            i = torch.arange(n)
            scores = scores.masked_fill((i[:, None] - i[None, :]).abs() > window, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        outs.append((weights @ vs).transpose(0, 1).reshape(n, -1))
        at += n
    return torch.cat(outs)


@pytest.mark.parametrize("lens", [[5], [1, 7, 3], [4, 4]])
def test_attention_stays_within_each_sequence_and_sees_every_position(lens: list[int]) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lens), HEADS, HEAD_DIM) for _ in range(3))
    out = EncoderAttention(HEADS, HEAD_DIM)(flat_batch(lens), q, k, v)
    torch.testing.assert_close(out, reference(q, k, v, lens), atol=1e-6, rtol=1e-5)
    first = reference(q[: lens[0]], k[: lens[0]], v[: lens[0]], lens[:1])
    torch.testing.assert_close(out[: lens[0]], first, atol=1e-6, rtol=1e-5)  # the others' tokens change nothing


def test_a_window_limits_each_token_to_its_neighbours() -> None:
    torch.manual_seed(1)
    lens = [9, 3, 12]
    q, k, v = (torch.randn(sum(lens), HEADS, HEAD_DIM) for _ in range(3))
    out = EncoderAttention(HEADS, HEAD_DIM, window=2)(flat_batch(lens), q, k, v)
    torch.testing.assert_close(out, reference(q, k, v, lens, window=2), atol=1e-6, rtol=1e-5)


def test_a_sequence_split_over_steps_is_an_error() -> None:
    q = torch.randn(3, HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="whole in one step"):
        EncoderAttention(HEADS, HEAD_DIM)(flat_batch([3], computed=[2]), q, q, q)
