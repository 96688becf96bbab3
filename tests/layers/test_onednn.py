"""oneDNN-prepacked float32 linears (backends/onednn.py) and the LM head's packed layouts (layers/dense.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import onednn
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.context import building
from pluginfer.layers.embedding import LMHead, VocabParallelEmbedding
from pluginfer.quant import unquantized
from tests.layers.conftest import PANELS_AVAILABLE, backend_with

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN")


def context(max_num_seqs: int, native_kernels: bool = True) -> BuildContext:
    return BuildContext(backend=backend_with(native_kernels), quant=unquantized.build(), collective=single.build(),
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


@pytest.mark.parametrize(("max_num_seqs", "native_kernels", "layout"), [
    (1, True, "panels"), (16, True, "panels"), (1, False, "transposed"), (16, False, "onednn")])
def test_untied_lm_head_is_packed(max_num_seqs: int, native_kernels: bool, layout: str) -> None:
    if layout == "panels" and not PANELS_AVAILABLE:
        pytest.skip("the panel kernel needs the native library on an AVX-512 CPU")
    torch.manual_seed(0)
    weight = torch.randn(100, 32)
    with building(context(max_num_seqs, native_kernels)):
        head = LMHead(100, 32)
    head.weight.weight_loader(head.weight, weight)
    assert head.layout == layout
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight), atol=1e-5, rtol=1e-5)


def test_tied_lm_head_keeps_the_embedding_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(100, 32)
    with building(context(16)):
        embedding, head = VocabParallelEmbedding(100, 32), LMHead(100, 32)
    head.tie(embedding)
    embedding.weight.weight_loader(embedding.weight, weight)
    assert head.layout == "checkpoint" and head.weight is embedding.weight
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight))
