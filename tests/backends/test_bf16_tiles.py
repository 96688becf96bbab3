"""Quantized linears past the fused kernel's rows on bfloat16 tiles (the cpu backend on a CPU with AMX-BF16):
the tile dequantized straight to bfloat16 by the C kernels, ``x`` rounded to bfloat16 once, torch's bfloat16
GEMM, float32 output. Checked against the float32-tile path within the bound docs/quantization.md states
("bfloat16 tiles"), for GGML blocks, GPTQ/AWQ groups and int4; the backend's choice (``native_quant.tile_dtype``:
AMX-BF16, ``PLUGINFER_QUANT_TILES``, ``PLUGINFER_QUANT_ACTIVATIONS=float``) and its one log line; and a
quantized llama's prefill through both paths: logits within a measured bound, the same greedy tokens.

The kernels' own rounding (bit-exact with ``Tensor.to(torch.bfloat16)`` of the float32 dequantization) is
tested beside their float32 tests: ``test_native_ggml.py``, ``test_native_grouped.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pluginfer import LLM
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.quant import ggml_blocks, int4
from pluginfer.quant.tiled import replace_weight
from tests.backends.test_native_grouped import random_int4, random_layer
from tests.backends.test_native_quant_dot import weight_bytes
from tests.checkpoints import greedy, prefill_logits, random_prompts, save_hf_model

T = GGMLQuantizationType
TILES, ACTIVATIONS = native_quant.QUANT_TILES_ENV, native_quant.QUANT_ACTIVATIONS_ENV


@pytest.fixture(scope="module", autouse=True)
def needs_native_kernels() -> None:
    reason = native.available()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")


@pytest.fixture
def fresh_logs() -> Iterator[None]:
    native_library._logged.clear()
    yield
    native_library._logged.clear()


def assert_within_bound(ours: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, float_path: torch.Tensor) -> None:
    """docs/quantization.md's bound between the bfloat16-tile and float32-tile paths, for ``y = x @ W.T``
    with K inputs: ``|ours - float| <= 2^-9 |y| + (2^-8 + 2^-16 + K 2^-23) * sum_i |x_i w_i|`` (x and W
    each rounded to bfloat16, the result rounded to bfloat16, two float32 accumulations)."""
    x64, w64 = x.double().reshape(-1, x.shape[-1]), weight.double()
    exact = x64 @ w64.T
    magnitudes = x64.abs() @ w64.abs().T
    k = x.shape[-1]
    bound = 2.0**-9 * exact.abs() + (2.0**-8 + 2.0**-16 + k * 2.0**-23) * magnitudes
    error = (ours.double().reshape(exact.shape) - float_path.double().reshape(exact.shape)).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    # Not vacuous: the paths differ, by about what bfloat16 rounding of the inputs gives.
    assert float(error.max()) > 0


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K, T.Q3_K], ids=lambda t: t.name)
def test_ggml_linear_on_bfloat16_tiles_within_the_bound(qtype: GGMLQuantizationType) -> None:
    rows, cols = 600, 512  # two tiles, the second partial
    raw = weight_bytes(qtype, rows, cols, seed=int(qtype))
    weight = ggml_blocks.dequantize(raw, qtype, cols)
    bf16_tiles = native_quant.GGMLDequantize(native_quant.ggml_dequantize, None, torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(rows, generator=generator)
    min_rows = bf16_tiles.tile_dtype_min_rows
    for shape in ((1, cols), (min_rows - 1, cols), (min_rows, cols), (2, 70, cols)):
        x = torch.randn(shape, generator=generator)
        ours = ggml_blocks.ggml_linear(x, raw, qtype, cols, None, bf16_tiles)
        float_path = ggml_blocks.ggml_linear(x, raw, qtype, cols, None, native_quant.ggml_dequantize)
        assert ours.dtype == torch.float32 and ours.shape == (*shape[:-1], rows)
        if x.numel() // cols < min_rows:  # too few rows to gain from bfloat16: the float32 tiles
            assert torch.equal(ours, float_path)
        else:
            assert_within_bound(ours, x, weight, float_path)
        # The bias is added in float32 to the float32 output.
        assert torch.equal(ggml_blocks.ggml_linear(x, raw, qtype, cols, bias, bf16_tiles), ours + bias)


def test_bfloat16_x_and_the_torch_fallback_take_bfloat16_tiles_too() -> None:
    """bfloat16 ``x`` multiplies bfloat16 tiles either way: dequantized by the kernel into its buffer, or (a
    kernel that declines, here a strided weight) by the torch dequantization rounded the same way."""
    rows, cols = 40, 256
    raw = weight_bytes(T.Q4_K, rows, cols, seed=5)
    bf16_tiles = native_quant.GGMLDequantize(native_quant.ggml_dequantize, None, torch.bfloat16)
    x = torch.randn(9, cols).bfloat16()
    expected = torch.matmul(x, ggml_blocks.dequantize(raw, T.Q4_K, cols).bfloat16().t())
    assert torch.equal(ggml_blocks.ggml_linear(x, raw, T.Q4_K, cols, None, bf16_tiles), expected)
    padded = torch.zeros(rows, raw.shape[1] + 16, dtype=torch.uint8)
    padded[:, :raw.shape[1]] = raw
    strided = padded[:, :raw.shape[1]]
    assert native_quant.ggml_dequantize(strided, T.Q4_K, cols) is None
    assert torch.equal(ggml_blocks.ggml_linear(x, strided, T.Q4_K, cols, None, bf16_tiles), expected)


def test_fused_kernel_up_to_its_rows_then_bfloat16_tiles(monkeypatch: pytest.MonkeyPatch, fresh_logs: None) -> None:
    monkeypatch.setenv(TILES, "bfloat16")
    monkeypatch.delenv(ACTIVATIONS, raising=False)
    kernel = native.op("ggml_dequantize")
    if kernel.quant_matmul is None:
        pytest.skip("no fused int8-activation kernel on this CPU")
    limit = kernel.quant_matmul_max_rows[int(T.Q4_K)]  # the AVX-512 VNNI kernel's, or the AMX int8 kernel's
    assert kernel.tile_dtype == torch.bfloat16
    assert limit in (native_quant.FUSED_MAX_ROWS_BEFORE_BFLOAT16_TILES, native_quant.AMX_INT8_MAX_ROWS[int(T.Q4_K)])
    assert kernel.quant_matmul_max_rows[int(T.Q5_K)] == native_quant.FUSED_MAX_ROWS_BEFORE_BFLOAT16_TILES  # no AMX
    cols = 256
    raw = weight_bytes(T.Q4_K, 64, cols, seed=2)
    tiles_only = native_quant.GGMLDequantize(native_quant.ggml_dequantize, None, torch.bfloat16)
    for rows in (limit, limit + 1):
        x = torch.randn(rows, cols)
        out = ggml_blocks.ggml_linear(x, raw, T.Q4_K, cols, None, kernel)
        if rows <= limit:
            assert torch.equal(out, native_quant.ggml_quant_matmul(x, raw, T.Q4_K, cols))
        else:
            assert torch.equal(out, ggml_blocks.ggml_linear(x, raw, T.Q4_K, cols, None, tiles_only))


@pytest.mark.parametrize("case", [(4, torch.float16, True), (8, torch.bfloat16, False)],
                         ids=["b4-act", "b8-groups"])
def test_grouped_layer_on_bfloat16_tiles_within_the_bound(case: tuple) -> None:
    bits, scale_dtype, act_order = case
    method, layer = random_layer(bits, scale_dtype, act_order, seed=3, out_features=600)
    weight = method.dequantize_columns(layer, 0, 600, torch.float32)
    x = torch.randn(33, layer.qweight.shape[0] * method.pack, generator=torch.Generator().manual_seed(4))
    layer.grouped_dequantize = native_quant.grouped_dequantize
    float_path = method.apply(layer, x, None)
    layer.grouped_dequantize = native_quant.TileDequantize(native_quant.grouped_dequantize, torch.bfloat16)
    assert_within_bound(method.apply(layer, x, None), x, weight, float_path)


def test_int4_layer_on_bfloat16_tiles_within_the_bound() -> None:
    method, layer = int4.Int4Linear(), nn.Module()
    layer.weight = nn.Parameter(torch.empty(1), requires_grad=False)
    qweight, scales, zeros = random_int4(600, 256, seed=3)
    replace_weight(layer, qweight=qweight, scales=scales, zeros=zeros)
    weight = int4.dequantize_int4(qweight, scales, zeros)
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(4))
    layer.int4_dequantize = native_quant.int4_dequantize
    float_path = method.apply(layer, x, None)
    layer.int4_dequantize = native_quant.TileDequantize(native_quant.int4_dequantize, torch.bfloat16)
    assert_within_bound(method.apply(layer, x, None), x, weight, float_path)


def test_tile_dtype_choice_and_its_log_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                            fresh_logs: None) -> None:
    caplog.set_level(logging.INFO, logger=native_library.__name__)
    monkeypatch.delenv(ACTIVATIONS, raising=False)
    monkeypatch.delenv(TILES, raising=False)
    auto = torch.bfloat16 if native_quant.bfloat16_gemm_is_fast() else torch.float32
    assert native_quant.tile_dtype() == auto
    native_quant.tile_dtype()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"quantized linears: tiles dequantized to {str(auto)[6:]}")

    monkeypatch.setenv(TILES, "float32")
    assert native_quant.tile_dtype() == torch.float32
    assert native.op("grouped_dequantize") is native_quant.grouped_dequantize
    assert native.op("int4_dequantize") is native_quant.int4_dequantize
    kernel = native.op("ggml_dequantize")
    assert getattr(kernel, "tile_dtype", torch.float32) == torch.float32
    assert ("quantized linears: tiles dequantized to float32 for torch's float32 GEMM (PLUGINFER_QUANT_TILES=float32)"
            in [r.getMessage() for r in caplog.records])

    monkeypatch.setenv(TILES, "bfloat16")
    assert native_quant.tile_dtype() == torch.bfloat16
    for name in ("grouped_dequantize", "int4_dequantize", "ggml_dequantize"):
        assert native.op(name).tile_dtype == torch.bfloat16, name
    # Float activations are the exact path: float32 tiles whatever PLUGINFER_QUANT_TILES says.
    monkeypatch.setenv(ACTIVATIONS, "float")
    assert native_quant.tile_dtype() == torch.float32 and native.op("ggml_dequantize") is native_quant.ggml_dequantize
    monkeypatch.setenv(TILES, "fp8")
    with pytest.raises(ValueError, match="PLUGINFER_QUANT_TILES='fp8'"):
        native_quant.tile_dtype()


# A quantized llama whose every input size is a multiple of 256 (K-quants).
K_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.05, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def k_llama(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("bf16_tiles_llama")
    save_hf_model("LlamaForCausalLM", K_LLAMA, out, tiny_tokenizer_dir)
    return out


@pytest.mark.parametrize("quant", ["q4_k", "int4"])
def test_prefill_on_bfloat16_tiles_against_float32_tiles(quant: str, k_llama: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A 300-token prompt (every linear past the fused kernel's rows) through bfloat16 tiles (forced, so
    this runs on any CPU) and float32 tiles: log-probabilities within 0.1 nats (measured 0.043 for q4_k,
    0.041 for int4: ~0.3 % per linear, compounded over two layers of this random model), and the same
    greedy continuation."""
    prompt = random_prompts(200, [300], seed=7)[0]
    results = {}
    for tiles in ("bfloat16", "float32"):
        monkeypatch.setenv(TILES, tiles)
        monkeypatch.delenv(ACTIVATIONS, raising=False)
        llm = LLM(model=str(k_llama), dtype="float32", num_blocks=128, block_size=8, quant=quant)
        layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "qweight")]
        kernels = {getattr(m, "ggml_dequantize", None) or getattr(m, "int4_dequantize", None) for m in layers}
        assert layers and {getattr(k, "tile_dtype", torch.float32) for k in kernels} == {getattr(torch, tiles)}
        results[tiles] = (prefill_logits(llm, prompt), llm.generate([prompt], greedy(8))[0].outputs[0].token_ids)
        del llm
    (ours, our_tokens), (floats, float_tokens) = results["bfloat16"], results["float32"]
    difference = (ours.log_softmax(-1) - floats.log_softmax(-1)).abs().max()
    assert 0 < float(difference) < 0.1, float(difference)
    assert our_tokens == float_tokens
