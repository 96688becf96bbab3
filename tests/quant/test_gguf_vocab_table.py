"""A GGUF file's embedding and LM head kept in their GGML blocks (``GGUFLinear.vocab_table``, ``layers.embedding``).

Oracle: the same table dequantized (``ggml_blocks.dequantize``, bit-exact with gguf-py) as a dense embedding
and head. The embedding is exact (it dequantizes the rows it gathers). The head is exact up to float32
rounding on float activations; on the fused int8-activation kernel it stays within docs/quantization.md's
bound: each activation moves by at most half its block's step, so ``|fused - float| <= sum over blocks of
(d_b / 2) * sum of |w| in the block`` (plus float32 accumulation, 2^-20 of the products' magnitudes).
On 1, 2 and 4 thread ranks with a vocabulary (1001) no rank count divides, tied and untied.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from pluginfer.backends.cpu import ops as native
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext, RankInfo
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from pluginfer.layers.embedding import LMHead, VocabParallelEmbedding
from pluginfer.layers.weights import load_named_weights
from pluginfer.quant import gguf, unquantized
from pluginfer.quant.ggml_blocks import dequantize, quantize_activations
from pluginfer.quant.ggml_quantize import quantize
from tests.layers.conftest import backend_with
from tests.layers.test_moe_tp import Holder, build_on, on_ranks, one_torch_thread

VOCAB = 1001
__all__ = ["one_torch_thread"]  # the fixture, autouse here too
FUSED = native.available() is None and native.op("ggml_quant_matmul") is not None
TYPES = {T.Q8_0: 64, T.Q4_0: 64, T.Q5_1: 64, T.Q4_K: 256, T.Q6_K: 256}  # type -> hidden size (whole blocks)


def tables(qtype: T, hidden: int) -> dict[str, GGMLTensor]:
    generator = torch.Generator().manual_seed(int(qtype))
    out = {}
    for name in ("embed.weight", "head.weight"):
        weight = torch.randn(VOCAB, hidden, generator=generator)
        out[name] = GGMLTensor(quantize(weight, qtype), qtype, torch.Size([VOCAB, hidden]), name)
    return out


def run(collective: object, qtype: T, ids: torch.Tensor, hidden: torch.Tensor, tied: bool,
        native_kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    world = collective.world_size
    ctx = BuildContext(backend=backend_with(native_kernels), quant=gguf.build(), collective=collective,
                       dtype=torch.float32, max_model_len=128,
                       rank=RankInfo(rank=collective.rank, world_size=world, tp_size=world))
    size = hidden.shape[-1]
    model = build_on(ctx, lambda: Holder(embed=VocabParallelEmbedding(VOCAB, size), head=LMHead(VOCAB, size)))
    loaded = tables(qtype, size)
    if tied:
        model.head.tie(model.embed)
        loaded.pop("head.weight")
    load_named_weights(model, loaded.items(), stacked=(), optional=("head.weight",) if tied else ())
    shard = -(-VOCAB // world)
    held = min(shard, VOCAB - collective.rank * shard)
    assert model.embed.table.rows == model.head.table.rows == held  # no padding rows stored
    assert model.embed.weight.numel() == model.head.weight.numel() == 0  # no dense copy
    assert (model.head.table is model.embed.table) == tied
    with torch.inference_mode():
        return model.embed(ids), model.head(hidden)


def fused_bound(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """docs/quantization.md's bound on ``|fused - float|`` per output, with float32 accumulation."""
    _, scales = quantize_activations(hidden)  # [rows, blocks]
    block_sums = weight.abs().reshape(weight.shape[0], -1, 32).sum(-1)  # [vocab, blocks]
    rounding = (hidden.abs().double() @ weight.abs().double().T) * 2.0 ** -20
    return (scales.double() / 2) @ block_sums.double().T + rounding


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("path", ["float", "fused", "torch"])
def test_quantized_table_equals_its_dequantized_weights(path: str, qtype: T, tied: bool, world_size: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "fused" and not FUSED:
        pytest.skip(f"the fused int8-activation kernel does not run here: {native.available()}")
    if path == "float":
        monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")
    size = TYPES[qtype]
    generator = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.tensor([0, 250, 251, 500, 501, 750, 999, 1000]),
                     torch.randint(0, VOCAB, (12,), generator=generator)])
    hidden = torch.randn(5, size, generator=generator)
    results = on_ranks(world_size, lambda c: run(c, qtype, ids, hidden, tied, path != "torch"))
    loaded = tables(qtype, size)
    embed = dequantize(loaded["embed.weight"].raw, qtype, size)
    head = embed if tied else dequantize(loaded["head.weight"].raw, qtype, size)
    expected = F.linear(hidden.double(), head.double())
    for embedded, logits in results:
        assert torch.equal(embedded, F.embedding(ids, embed))
        assert logits.shape == (5, VOCAB) and logits.dtype == torch.float32
        if path == "fused":
            assert ((logits.double() - expected).abs() <= fused_bound(hidden, head)).all()
            assert not torch.equal(logits, results[0][1].new_zeros(logits.shape))
        else:  # float activations: the same products, summed in float32
            torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-4)
    for _, logits in results[1:]:  # every rank gathers the same logits, and the same as one rank would
        assert torch.equal(logits, results[0][1])


def context(quant: object) -> BuildContext:
    return BuildContext(backend=backend_with(False), quant=quant, collective=single.build(), dtype=torch.float32,
                        max_model_len=128)


def test_a_table_the_quant_method_cannot_hold_is_an_error() -> None:
    class Opaque:  # a quantized tensor the unquantized method knows nothing of
        shape = torch.Size([VOCAB, 64])

    model = build_on(context(unquantized.build()), lambda: Holder(embed=VocabParallelEmbedding(VOCAB, 64)))
    with pytest.raises(ValueError, match="embed.weight.*Opaque checkpoint tensor.*quant method 'none' cannot hold"):
        load_named_weights(model, [("embed.weight", Opaque())], stacked=())


def test_blocks_that_do_not_fit_the_shape_are_an_error() -> None:
    model = build_on(context(gguf.build()), lambda: Holder(embed=VocabParallelEmbedding(VOCAB, 64)))
    short = GGMLTensor(torch.zeros(VOCAB, 10, dtype=torch.uint8), T.Q8_0, torch.Size([VOCAB, 64]), "token_embd.weight")
    with pytest.raises(ValueError, match=r"token_embd.weight: Q8_0 blocks of shape \(1001, 10\), expected \(1001, 68\)"):
        load_named_weights(model, [("embed.weight", short)], stacked=())
