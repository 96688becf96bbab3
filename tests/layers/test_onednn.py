"""oneDNN-prepacked float32 linears (layers/onednn.py) and the LM head that uses them when batched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends import cpu
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext
from pluginfer.layers import onednn
from pluginfer.layers.context import building
from pluginfer.layers.embedding import LMHead, VocabParallelEmbedding
from pluginfer.quant import unquantized

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN")


def context(max_num_seqs: int) -> BuildContext:
    return BuildContext(backend=cpu.build(), quant=unquantized.build(), collective=single.build(),
                        dtype=torch.float32, max_model_len=64, max_num_seqs=max_num_seqs)


def test_packed_linear_equals_dense() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(130, 72), torch.randn(130)
    packed = onednn.pack(weight)
    for shape in ((1, 72), (16, 72), (3, 7, 72)):
        x = torch.randn(*shape)
        torch.testing.assert_close(onednn.linear(x, packed, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(onednn.linear(x, packed, None), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_worth_packing_only_batched_float32_cpu_weights() -> None:
    weight = torch.randn(8, 8)
    assert onednn.worth_packing(weight, batched=True)
    assert not onednn.worth_packing(weight, batched=False)
    assert not onednn.worth_packing(weight.bfloat16(), batched=True)


@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_lm_head_packs_when_batched_and_untied(max_num_seqs: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(100, 32)
    with building(context(max_num_seqs)):
        head = LMHead(100, 32)
    head.weight.weight_loader(head.weight, weight)
    assert head.packed == (max_num_seqs > 1)
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight), atol=1e-5, rtol=1e-5)


def test_tied_lm_head_keeps_the_embedding_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(100, 32)
    with building(context(16)):
        embedding, head = VocabParallelEmbedding(100, 32), LMHead(100, 32)
    head.tie(embedding)
    embedding.weight.weight_loader(embedding.weight, weight)
    assert not head.packed and head.weight is embedding.weight
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight))
