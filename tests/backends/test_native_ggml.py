"""The native GGML dequantization (``native_quant.ggml_dequantize``, the cpu backend's ``ggml_dequantize`` op)
against its oracle, ``ggml_blocks.dequantize`` (itself bit-exact with gguf-py): equal bit for bit
(NaN where NaN) for every type it handles; and the matmuls that use it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pluginfer import LLM
from pluginfer.backends.cpu import build as native_build
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.quant import ggml_blocks, ggml_quantize
from pluginfer.quant.tiled import TILE_ROWS
from tests.checkpoints import prefill_logits, random_prompts, save_hf_model
from tests.quant.test_ggml_blocks import FP16_FIELDS, raw_blocks

T = GGMLQuantizationType
HANDLED = list(FP16_FIELDS)  # Q4_0 ... Q8_0, Q2_K ... Q6_K
# fp16 bit patterns a scale field may hold: ±0, the smallest and largest subnormals, the smallest
# normal, the largest finite, ±inf, a quiet and a signaling NaN, and ordinary values.
FP16_EDGES = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01,
              0x3C00, 0xB800]


@pytest.fixture(scope="module", autouse=True)
def needs_native_kernels() -> None:
    reason = native.available()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")


def assert_bit_equal(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit (-0, subnormals, infinities), NaN where NaN: a NaN's payload is not part of
    the contract (which NaN operand x86 propagates depends on operand order inside torch's kernels)."""
    assert ours.dtype == expected.dtype == torch.float32 and ours.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int32), expected[~nan].view(torch.int32))


def assert_bf16_rounding(ours: torch.Tensor, float32: torch.Tensor) -> None:
    """``ours`` is ``float32.to(torch.bfloat16)`` bit for bit (round to nearest even), NaN where NaN."""
    expected = float32.to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and ours.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def cols_of(qtype: GGMLQuantizationType) -> int:
    return 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96


@pytest.mark.parametrize("rows", [9, 300], ids=["one-thread", "openmp"])
@pytest.mark.parametrize("qtype", HANDLED, ids=lambda t: t.name)
def test_dequantize_is_bit_exact_with_ggml_blocks(qtype: GGMLQuantizationType, rows: int) -> None:
    """Random bytes with ggml_blocks' edge rows (all zero, all 0xff with a negative scale, finite
    scales); random scales further down include subnormals, infinities and NaNs."""
    cols = cols_of(qtype)
    raw = torch.from_numpy(raw_blocks(qtype, rows=rows, cols=cols, seed=int(qtype) + rows))
    assert_bit_equal(native_quant.ggml_dequantize(raw, qtype, cols), ggml_blocks.dequantize(raw, qtype, cols))


@pytest.mark.parametrize("rows", [9, 300], ids=["one-thread", "openmp"])
@pytest.mark.parametrize("qtype", HANDLED, ids=lambda t: t.name)
def test_dequantize_to_bfloat16_rounds_the_float32_values_as_torch_does(qtype: GGMLQuantizationType,
                                                                        rows: int) -> None:
    """The bfloat16 output (one pass, for the AMX GEMM) is the float32 dequantization rounded to nearest
    even, as ``Tensor.to(torch.bfloat16)``; new or into a caller's buffer (its dtype picks the output)."""
    cols = cols_of(qtype)
    raw = torch.from_numpy(raw_blocks(qtype, rows=rows, cols=cols, seed=int(qtype) + rows))
    expected = ggml_blocks.dequantize(raw, qtype, cols)
    assert_bf16_rounding(native_quant.ggml_dequantize(raw, qtype, cols, dtype=torch.bfloat16), expected)
    buffer = torch.full((rows * cols + 7,), 7.0, dtype=torch.bfloat16)
    into = native_quant.ggml_dequantize(raw, qtype, cols, buffer)
    assert into.data_ptr() == buffer.data_ptr() and (buffer[rows * cols:] == 7.0).all()
    assert_bf16_rounding(into, expected)


@pytest.fixture(scope="module")
def portable_library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """dequant.c built without AVX-512: the generic bfloat16 dequantization a CPU without it runs (this
    one takes AVX-512 versions for Q4_0, Q8_0, Q4_K and Q6_K)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLUGINFER_CACHE", str(tmp_path_factory.mktemp("no_avx512")))
        patch.setattr(native_build, "FLAGS", [*native_build.FLAGS, "-mno-avx512f"])
        try:
            library, _, _ = native_build.build_library("dequant_no_avx512", (native_library.SOURCES[0].with_name("dequant.c"),))
        except native_build.NativeKernelsUnavailable as exc:
            pytest.skip(f"cannot build dequant.c without AVX-512 here: {exc}")
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.ggml_dequantize_rows_bf16.argtypes = [ctypes.c_int, pointer, i64, i64, i64, pointer]
    return library


@pytest.mark.parametrize("qtype", HANDLED, ids=lambda t: t.name)
def test_dequantize_to_bfloat16_without_avx512(portable_library: ctypes.CDLL, qtype: GGMLQuantizationType) -> None:
    cols, rows = cols_of(qtype), 40
    raw = torch.from_numpy(raw_blocks(qtype, rows=rows, cols=cols, seed=int(qtype) + 7))
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    assert portable_library.ggml_dequantize_rows_bf16(int(qtype), raw.data_ptr(), rows, raw.shape[1], cols,
                                                      out.data_ptr()) == 0
    assert_bf16_rounding(out, ggml_blocks.dequantize(raw, qtype, cols))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", HANDLED, ids=lambda t: t.name)
def test_every_fp16_edge_value_in_every_scale_field(qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    cols = cols_of(qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    edges = np.array(FP16_EDGES, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    blocks = rng.integers(0, 256, size=(len(FP16_EDGES) ** 2, type_size), dtype=np.uint8)
    for field, offset in enumerate(FP16_FIELDS[qtype]):  # every pair of edge values for d and dmin
        pick = np.arange(len(blocks)) // len(FP16_EDGES) ** field % len(FP16_EDGES)
        blocks[:, offset:offset + 2] = edges[pick]
    blocks = np.concatenate([blocks, np.zeros(((-len(blocks)) % (cols // block), type_size), np.uint8)])
    raw = torch.from_numpy(blocks.reshape(-1, cols // block * type_size))
    if dtype == torch.bfloat16:
        assert_bf16_rounding(native_quant.ggml_dequantize(raw, qtype, cols, dtype=dtype), ggml_blocks.dequantize(raw, qtype, cols))
    else:
        assert_bit_equal(native_quant.ggml_dequantize(raw, qtype, cols), ggml_blocks.dequantize(raw, qtype, cols))


def test_out_buffer_and_declined_types() -> None:
    raw = torch.from_numpy(raw_blocks(T.Q4_K, rows=6, cols=256, seed=1))
    out = torch.full((10, 256), 7.0)
    result = native_quant.ggml_dequantize(raw, T.Q4_K, 256, out)
    assert result.data_ptr() == out.data_ptr() and result.shape == (6, 256)
    assert_bit_equal(result, ggml_blocks.dequantize(raw, T.Q4_K, 256))
    assert (out[6:] == 7.0).all()  # only rows * cols elements written

    # Types without a C decoder, and strided rows, are declined: the caller keeps the torch path.
    assert native_quant.ggml_dequantize(torch.zeros(2, 512, dtype=torch.uint8), T.F16, 256) is None
    assert native_quant.ggml_dequantize(torch.zeros(1, 66, dtype=torch.uint8), T.IQ2_XXS, 256) is None
    assert native_quant.ggml_dequantize(raw[:, :72], T.Q4_K, 256) is None
    with pytest.raises(ValueError, match="do not fit rows of 144 bytes"):
        native_quant.ggml_dequantize(raw, T.Q4_K, 512)
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16 out"):
        native_quant.ggml_dequantize(raw, T.Q4_K, 256, torch.empty(5, 256))
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16 out"):
        native_quant.ggml_dequantize(raw, T.Q4_K, 256, torch.empty(6 * 256, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous torch.bfloat16 out"):
        native_quant.ggml_dequantize(raw, T.Q4_K, 256, torch.empty(6 * 256), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="writes float32 or bfloat16, not torch.float16"):
        native_quant.ggml_dequantize(raw, T.Q4_K, 256, dtype=torch.float16)
    assert native.NATIVE["ggml_dequantize"] is native_quant.ggml_dequantize


def finite_raw(qtype: GGMLQuantizationType, rows: int, cols: int) -> torch.Tensor:
    raw = raw_blocks(qtype, rows, cols, seed=3)
    for offset in FP16_FIELDS.get(qtype, []):  # finite scales in every row: finite weights
        raw.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])[:, :, offset + 1] &= 0x3B
    return torch.from_numpy(raw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_ggml_linear_with_the_kernel_equals_the_torch_path(qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    """Exactly equal: every tile holds the same bits either way and goes through the same matmul
    (same shapes, strides and alignment), so the products and sums are the same. F16 is declined
    by the kernel and falls back to the torch dequantization."""
    rows, cols = 1100, 256  # three tiles of rows, the last one partial
    raw = (ggml_quantize.quantize(torch.randn(rows, cols), qtype) if qtype == T.F16 else finite_raw(qtype, rows, cols))
    x, bias = torch.randn(3, 4, cols).to(dtype), torch.randn(rows).to(dtype)
    calls: list[tuple[int, int]] = []

    def kernel(part: torch.Tensor, qtype: int, cols: int, out: torch.Tensor | None) -> torch.Tensor | None:
        calls.append((part.shape[0], 0 if out is None else out.data_ptr()))
        return native_quant.ggml_dequantize(part, qtype, cols, out)

    expected = ggml_blocks.ggml_linear(x, raw, qtype, cols, bias)
    out = ggml_blocks.ggml_linear(x, raw, qtype, cols, bias, kernel)
    assert expected.isfinite().all()
    assert torch.equal(out, expected)
    assert [rows for rows, _ in calls] == [TILE_ROWS, TILE_ROWS, rows - 2 * TILE_ROWS]
    buffers = {pointer for _, pointer in calls}
    # float32: one reused scratch tile; other dtypes: the kernel allocates and the tile is converted.
    if dtype == torch.float32:
        assert len(buffers) == 1 and 0 not in buffers
    else:
        assert buffers == {0}


# The in-situ q4_k llama of test_ggml_insitu (every input size a multiple of 256).
K_LLAMA = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def k_llama(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("k_llama")
    save_hf_model("LlamaForCausalLM", K_LLAMA, out, tiny_tokenizer_dir)
    return out


@pytest.fixture
def native_disabled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PLUGINFER_NATIVE", "0")
    native_library.load.cache_clear()
    yield
    monkeypatch.delenv("PLUGINFER_NATIVE")
    native_library.load.cache_clear()


def q4_k_logits(path: Path, prompt: list[int]) -> tuple[torch.Tensor, set]:
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, quant="q4_k")
    layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "qweight")]
    assert layers
    return prefill_logits(llm, prompt), {m.ggml_dequantize for m in layers}


def test_q4_k_llama_logits_with_and_without_the_native_dequantization(
        k_llama: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    # The dequantizing path throughout: the fused int8-activation matmul (tests/backends/
    # test_native_quant_dot.py) quantizes the activations, so its logits differ from these by design.
    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")
    prompt = random_prompts(200, [40], seed=5)[0]
    logits, kernels = q4_k_logits(k_llama, prompt)
    assert kernels == {native_quant.ggml_dequantize}

    # The same native backend without this one op: identical logits (the tiles are the same bits).
    with monkeypatch.context() as patch:
        patch.delitem(native.NATIVE, "ggml_dequantize")
        without_op, kernels = q4_k_logits(k_llama, prompt)
    assert kernels == {None}
    assert torch.equal(logits, without_op)

    # PLUGINFER_NATIVE=0: the torch path everywhere; the other native kernels (norm, rotary,
    # attention) round differently from torch, so only close.
    request.getfixturevalue("native_disabled")
    torch_logits, kernels = q4_k_logits(k_llama, prompt)
    assert kernels == {None}
    torch.testing.assert_close(logits, torch_logits, atol=1e-4, rtol=1e-4)
