"""Vocabulary-parallel embedding and LM head on 2 and 4 thread ranks, with a vocabulary (1001) no rank count
divides: each rank holds ``ceil(1001 / tp)`` rows, the last rank's extra rows are zero padding, and the
head's logits are cut back to 1001 columns. Float32 bound as in tests/layers/test_moe_tp.py (1e-5 of the
largest magnitude); the embedding sums one non-zero row per token, so it is exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.layers.embedding import LMHead, VocabParallelEmbedding
from pluginfer.layers.weights import load_named_weights
from tests.layers.test_moe_tp import (
    Holder,
    assert_tp_matches,
    build_on,
    on_ranks,
    one_torch_thread,
    rank_context,
)

VOCAB, HIDDEN = 1001, 48
__all__ = ["one_torch_thread"]  # the fixture, autouse here too


def weights(seed: int = 0, negative: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    embed, head = (torch.randn(VOCAB, HIDDEN, generator=generator) for _ in range(2))
    if negative:  # with positive hidden states every real logit is below a padding row's 0
        head = -head.abs() - 0.1
    return {"embed.weight": embed, "head.weight": head, "head.bias": torch.randn(VOCAB, generator=generator)}


def run(collective: object, ids: torch.Tensor, hidden: torch.Tensor, tied: bool, bias: bool,
        native: bool = True, max_num_seqs: int = 1, negative: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = rank_context(collective, native=native, max_num_seqs=max_num_seqs)
    model = build_on(ctx, lambda: Holder(embed=VocabParallelEmbedding(VOCAB, HIDDEN),
                                         head=LMHead(VOCAB, HIDDEN, bias=bias)))
    shard = -(-VOCAB // collective.world_size)
    assert model.embed.weight.shape == (shard, HIDDEN) and model.head.shard_size == shard
    loaded = weights(negative=negative)
    if tied:
        model.head.tie(model.embed)
        loaded.pop("head.weight")
    if not bias:
        loaded.pop("head.bias")
    load_named_weights(model, loaded.items(), stacked=(), optional=("head.weight",) if tied else ())
    if collective.world_size > 1 and collective.rank == collective.world_size - 1:  # padding rows stay zero
        padding = shard * collective.world_size - VOCAB
        assert padding > 0 and not model.embed.weight[shard - padding:].any()
        assert bias is False or not model.head.bias[shard - padding:].any()
    with torch.inference_mode():
        return model.embed(ids), model.head(hidden)


def reference(ids: torch.Tensor, hidden: torch.Tensor, tied: bool, bias: bool,
              negative: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    loaded = weights(negative=negative)
    head = loaded["embed.weight" if tied else "head.weight"]
    return F.embedding(ids, loaded["embed.weight"]), F.linear(hidden, head, loaded["head.bias"] if bias else None)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("tied,bias", [(False, False), (True, False), (False, True)],
                         ids=["untied", "tied", "bias"])
@pytest.mark.parametrize("native,max_num_seqs", [(True, 1), (False, 1), (False, 16)],
                         ids=["panels", "transposed", "onednn"])
def test_embedding_and_head_on_ranks_equal_one_rank(world_size: int, tied: bool, bias: bool, native: bool,
                                                    max_num_seqs: int) -> None:
    generator = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.tensor([0, 500, 501, 750, 999, 1000]), torch.randint(0, VOCAB, (20,), generator=generator)])
    hidden = torch.randn(7, HIDDEN, generator=generator)
    ref_embed, ref_logits = on_ranks(1, lambda c: run(c, ids, hidden, tied, bias, native, max_num_seqs))[0]
    expected_embed, expected_logits = reference(ids, hidden, tied, bias)
    assert torch.equal(ref_embed, expected_embed)
    torch.testing.assert_close(ref_logits, expected_logits, rtol=1e-5, atol=1e-5)
    results = on_ranks(world_size, lambda c: run(c, ids, hidden, tied, bias, native, max_num_seqs))
    assert_tp_matches([embed for embed, _ in results], ref_embed, rel=0.0)
    assert_tp_matches([logits for _, logits in results], ref_logits)
    assert results[0][1].shape == (7, VOCAB)


@pytest.mark.parametrize("native", [True, False], ids=["panels", "transposed"])
def test_padding_rows_never_win(native: bool) -> None:
    """Every real logit is negative; a padding row (logit 0) would win the argmax if it were not cut off."""
    hidden = torch.rand(5, HIDDEN, generator=torch.Generator().manual_seed(2)) + 0.1
    ids = torch.tensor([3])
    _, expected = reference(ids, hidden, tied=False, bias=False, negative=True)
    assert expected.max() < 0
    results = on_ranks(2, lambda c: run(c, ids, hidden, tied=False, bias=False, native=native, negative=True))
    logits = results[0][1]
    assert logits.shape == (5, VOCAB) and logits.max() < 0
    assert torch.equal(logits.argmax(dim=-1), expected.argmax(dim=-1))


def test_checkpoint_of_the_wrong_vocabulary_is_an_error() -> None:
    def load_short(collective: object) -> None:
        ctx = rank_context(collective)
        model = build_on(ctx, lambda: Holder(embed=VocabParallelEmbedding(VOCAB, HIDDEN),
                                             head=LMHead(VOCAB, HIDDEN, bias=True)))
        with pytest.raises(ValueError, match=r"checkpoint shape \(1000, 48\) does not match \(1001, 48\)"):
            load_named_weights(model, [("embed.weight", torch.zeros(1000, HIDDEN))], stacked=())
        with pytest.raises(ValueError, match=r"lm_head bias: checkpoint shape \(1000,\)"):
            model.head.bias.weight_loader(model.head.bias, torch.zeros(1000))

    on_ranks(2, load_short)
