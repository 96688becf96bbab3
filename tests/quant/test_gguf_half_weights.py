"""A GGUF file's F16/BF16 tensors in a float32 model, kept as the file stores them (``quant/gguf.py``): the
embedding and LM head as a ``GGMLVocabTable`` of 16-bit rows, the linears as 16-bit weights, both read in
place by the cpu backend's ``half_linear`` op (float32 activations: ``half_weight_linear``) for a few rows,
and by tiles widened to float32 for torch's GEMM above; or, on a CPU with AVX2 or AVX-512 and without AMX, packed at
load into the backend's 16-bit panels (ops ``ggml_half_pack`` / ``ggml_half_linear``; the embedding still
reads the file's rows).

Oracle: the same weights widened to float32 (exact) and multiplied in float64. Widening is exact and every
sum is float32, so each output is within ``(k + 2) * 2^-24 * S`` of the exact value (``S`` the sum of the
products' magnitudes), whichever path ran; the embedding is exact. End to end, the llama.cpp F16 file
generates as transformers does (tests/quant/test_gguf_llamacpp.py) and its replayed decode steps equal
the eager ones (tests/backends/test_cpu_step_replay.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from pluginfer import LLM
from pluginfer.backends.cpu import amx_half, half_panels
from pluginfer.backends.cpu import half_linear as native_half_linear
from pluginfer.backends.cpu import ops as native
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from pluginfer.layers.embedding import LMHead, VocabParallelEmbedding
from pluginfer.layers.weights import load_named_weights
from pluginfer.quant import gguf
from tests.layers.conftest import backend_with
from tests.layers.test_moe_tp import Holder, build_on

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB, HIDDEN = 1001, 96
HALF = {T.F16: torch.float16, T.BF16: torch.bfloat16}
NATIVE = native.available() is None and native_half_linear.half_linear_isa() is not None


@pytest.fixture(params=["stored", "panels"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the cpu backend keeps a float32 model's 16-bit weights: as the file stores them (a CPU with AMX-BF16,
    whose tiles read them, or without AVX2) or packed into its 16-bit panels (AVX2 or AVX-512, without AMX)."""
    if request.param == "stored":
        monkeypatch.setitem(native.NATIVE, "ggml_half_pack", lambda weight: None)
    elif not NATIVE or not half_panels.supported():
        pytest.skip("no 16-bit panel GEMM here (it needs AVX2 with FMA and F16C)")
    else:
        monkeypatch.setattr(amx_half, "library", lambda: None)
    return request.param


def table(qtype: T, name: str, seed: int) -> tuple[torch.Tensor, GGMLTensor]:
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(HALF[qtype])
    return weight, GGMLTensor(weight.view(torch.uint8), qtype, torch.Size([VOCAB, HIDDEN]), name)


def within_float32_sums(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The GEMV's float32 bound; on the AMX tiles (amx_half.FLOAT_X_MIN_ROWS..MAX_ROWS rows) x split exactly
    into three bfloat16 and a float16 w into two, 5 products a pair: test_native_amx_half_float_x.py's bound."""
    exact, size = x.double() @ weight.double().T, x.double().abs() @ weight.double().abs().T
    k = weight.shape[1]
    limit = (k + 2) * 2.0**-24 * size
    if amx_half.takes_float_x(weight.dtype, x.shape[0]):
        limit = 2.0**-22 * size + 2.0**-125 * weight.double().abs().sum(dim=1) + (5 * k + 1) * 2.0**-24 * 1.01 * size
    return bool(((out.double() - exact).abs() <= limit).all())


@pytest.mark.parametrize("native_kernels", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("qtype", list(HALF), ids=lambda t: t.name)
def test_a_16_bit_table_is_read_in_place(qtype: T, native_kernels: bool, layout: str) -> None:
    if native_kernels and not NATIVE:
        pytest.skip("no native 16-bit GEMV here")
    if not native_kernels and layout == "panels":
        pytest.skip("the torch path has one layout")
    ctx = BuildContext(backend=backend_with(native_kernels), quant=gguf.build(), collective=single.build(),
                       dtype=torch.float32, max_model_len=128)
    model = build_on(ctx, lambda: Holder(embed=VocabParallelEmbedding(VOCAB, HIDDEN), head=LMHead(VOCAB, HIDDEN)))
    embed, embed_loaded = table(qtype, "token_embd.weight", 1)
    head, head_loaded = table(qtype, "output.weight", 2)
    load_named_weights(model, [("embed.weight", embed_loaded), ("head.weight", head_loaded)], stacked=())
    assert model.embed.weight.numel() == model.head.weight.numel() == 0  # no float32 copy
    assert model.head.table.raw.data_ptr() == head_loaded.raw.data_ptr()  # the file's bytes themselves
    assert (model.head.table.half is not None) == native_kernels
    assert (model.head.table.head is not None) == (layout == "panels")  # the head packed, the embedding in place
    ids = torch.tensor([0, 1000, 7, 500, 7])
    generator = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        assert torch.equal(model.embed(ids), F.embedding(ids, embed.float()))
        # the GEMV's rows, then tiles for torch's GEMM; every tile kind of the panels
        for rows in (1, 3, native_half_linear.HALF_WEIGHT_MAX_ROWS, 40, 64):
            hidden = torch.randn(rows, HIDDEN, generator=generator)
            logits = model.head(hidden)
            assert logits.shape == (rows, VOCAB) and logits.dtype == torch.float32
            assert within_float32_sums(logits, hidden, head)


def test_f16_linears_stay_16_bit_in_a_float32_model(layout: str) -> None:
    if not NATIVE:
        pytest.skip("no native 16-bit GEMV here")
    path = FIXTURES / "llamacpp-llama-f16.gguf"
    with LLM(str(path), num_blocks=64, block_size=8) as llm:
        model = llm.engine.executor.pipeline.model
        layer = model.layers[0]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            kept = [weight.packed if isinstance(weight, gguf.PackedHalf) else weight for _, weight in linear.gguf_groups]
            assert [weight.dtype for weight in kept] == [torch.float16]
            assert all(isinstance(weight, gguf.PackedHalf) == (layout == "panels") for _, weight in linear.gguf_groups)
        assert model.embed_tokens.table.qtype == T.F16
    # another model dtype converts them at load, as before
    with LLM(str(path), num_blocks=64, block_size=8, dtype="bfloat16") as llm:
        layer = llm.engine.executor.pipeline.model.layers[0]
        assert [weight.dtype for _, weight in layer.mlp.down_proj.gguf_groups] == [torch.bfloat16]


@pytest.mark.skipif(not NATIVE, reason="no native 16-bit GEMV here")
@pytest.mark.parametrize("rows", [1, 2, 16, 33, 64])
def test_a_16_bit_linear_through_the_quant_method(rows: int, layout: str) -> None:
    ctx = BuildContext(backend=backend_with(True), quant=gguf.build(), collective=single.build(),
                       dtype=torch.float32, max_model_len=128)
    from pluginfer.layers.linear import RowParallelLinear

    layer = build_on(ctx, lambda: Holder(proj=RowParallelLinear(HIDDEN, 70, bias=False)))
    weight = torch.randn(70, HIDDEN, generator=torch.Generator().manual_seed(rows)).half()
    load_named_weights(layer, [("proj.weight", weight)], stacked=())
    layer.proj.quant_method.process_weights_after_loading(layer.proj)
    (_, kept), = layer.proj.gguf_groups
    if layout == "stored":
        assert kept.dtype == torch.float16 and kept.data_ptr() == weight.data_ptr()  # read in place
    else:
        assert isinstance(kept, gguf.PackedHalf) and kept.packed.dtype == torch.float16 and kept.out_features == 70
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(100 + rows))
    with torch.inference_mode():
        out = layer.proj(x)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == torch.float32 and within_float32_sums(out, x, weight)


@pytest.mark.skipif(not NATIVE, reason="no native 16-bit GEMV here")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_a_16_bit_models_linears_take_the_16_bit_gemv(dtype: torch.dtype, rows: int) -> None:
    """In a float16/bfloat16 model a GGUF file's 16-bit linear is the backend's ``half_linear`` op, as an HF
    checkpoint's is (it was torch's ``F.linear``, ~1.6x slower at one row): the op's bits up to its rows,
    ``F.linear``'s above."""
    ctx = BuildContext(backend=backend_with(True), quant=gguf.build(), collective=single.build(),
                       dtype=dtype, max_model_len=128)
    from pluginfer.layers.linear import RowParallelLinear

    layer = build_on(ctx, lambda: Holder(proj=RowParallelLinear(HIDDEN, 70, bias=False)))
    weight = torch.randn(70, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
    load_named_weights(layer, [("proj.weight", weight)], stacked=())
    layer.proj.quant_method.process_weights_after_loading(layer.proj)
    (_, kept), = layer.proj.gguf_groups
    assert kept.dtype == dtype and layer.proj.gguf_half is not None
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(100 + rows)).to(dtype)
    with torch.inference_mode():
        out = layer.proj(x)
        out = out[0] if isinstance(out, tuple) else out
        native_out = native_half_linear.half_linear(x, kept, None)
        expected = F.linear(x, kept) if native_out is None else native_out
    assert out.dtype == dtype and torch.equal(out, expected)
