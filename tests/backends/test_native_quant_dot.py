"""The fused quantized matmul (``native_quant.ggml_quant_matmul``, ``csrc/quant_dot.c``) against its references.

Two oracles. The exact one: the activations rounded as the kernel rounds them
(``ggml_blocks.quantize_activations``, which the kernel's own quantization equals bit for bit), times
the weights dequantized by the bit-exact torch dequantizer, in float64: the kernel differs only by
float32 accumulation. The float-activation path (``x @ dequantize(W).T``, what the engine computed
before): the kernel differs by the activations' rounding, at most half a step of each block, and the
test holds it to that bound (and to ~1 % of the outputs' size, docs/quantization.md "Accuracy").
Then: rows 1..17 (every tile shape), one and two threads, batch invariance, NaN and Inf, the wiring
(``ggml_linear``'s row threshold, ``PLUGINFER_QUANT_ACTIVATIONS``, the fallback's log line) and a
quantized llama's logits.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pluginfer import LLM
from pluginfer.backends.cpu import build as native_build
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.quant import ggml_blocks, ggml_quantize
from tests.checkpoints import greedy, prefill_logits, random_prompts, save_hf_model
from tests.quant.test_ggml_blocks import FP16_FIELDS

T = GGMLQuantizationType
FUSED = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
ENV = "PLUGINFER_QUANT_ACTIVATIONS"


@pytest.fixture(scope="module", autouse=True)
def fused_kernel() -> None:
    reason = native.available()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")
    if not native_quant.quant_dot_supported():
        pytest.skip("the fused kernel needs AVX2 (the dequantizing path runs instead)")


def weight_bytes(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random levels (every bit pattern of the level, high-bit and 6-bit scale fields) with finite fp16
    scales; row 0 all zero, row 1 all 0xff (every field at its maximum) with scale -0.75."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    raw[0] = 0
    raw[1] = 0xFF
    for offset in FP16_FIELDS[qtype]:
        scales = (rng.standard_normal((rows, cols // block)) * 0.05).astype(np.float16)
        scales[1] = -0.75
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def cols_for(qtype: GGMLQuantizationType, blocks: int) -> int:
    return blocks * GGML_QUANT_SIZES[qtype][0]


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """float64 ``levels * scales``: the activations the kernel multiplies."""
    levels, scales = ggml_blocks.quantize_activations(x)
    return (levels.double().unflatten(-1, (-1, 32)) * scales.double()[..., None]).flatten(-2)


def assert_exact_oracle(out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> None:
    """Against float64 ``rounded x @ W.T``: float32 accumulation over blocks (16 lanes, then a tree of
    4 additions) errs by at most ~(blocks / 2 + 6) ulps of the sum of |products|; allow 2^-20 of it."""
    xq = rounded_activations(x)
    expected = xq @ weights.T
    scale = xq.abs() @ weights.abs().T
    error = (out.double() - expected).abs()
    assert (error <= scale * 2**-20 + 1e-30).all(), float((error / scale.clamp(min=1e-30)).max())


def half_step_bound(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``|fused - float path| <= sum over blocks of (scale / 2) * sum |w|``: each activation moves by at
    most half of its block's step ``d`` when rounded."""
    _, scales = ggml_blocks.quantize_activations(x)
    per_block = weights.abs().unflatten(-1, (-1, 32)).sum(-1)  # [out, blocks]
    return 0.5 * scales.double() @ per_block.T


@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=lambda n: f"{n}-thread")
def test_kernel_equals_the_int8_reference_for_every_row_count(qtype: GGMLQuantizationType, threads: int) -> None:
    """37 outputs (not a multiple of the tiles' 2 or 4 outputs, nor of 8 or 16); 3 blocks of 32 (an
    odd count: the last vector holds one block) or 2 super-blocks of 256; rows 1..17 (every tile of
    rows, and 16 + 1)."""
    openmp = native_library.loaded_build["info"].openmp
    assert native_library.load().quant_dot_max_threads() == (threads if openmp else 1)  # the kernel's OpenMP is torch's
    cols = cols_for(qtype, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 3)
    raw = weight_bytes(qtype, 37, cols, seed=int(qtype))
    weights = ggml_blocks.dequantize(raw, qtype, cols).double()
    generator = torch.Generator().manual_seed(int(qtype))
    for rows in range(1, 18):
        x = torch.randn(rows, cols, generator=generator)
        out = native_quant.ggml_quant_matmul(x, raw, qtype, cols)
        assert out.shape == (rows, 37) and out.dtype == torch.float32
        assert_exact_oracle(out, x, weights)


@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
def test_kernel_stays_within_half_a_step_of_the_float_path(qtype: GGMLQuantizationType) -> None:
    """Real quantized weights (ggml_quantize; Q5_K, which we do not quantize, random bytes), 2048
    inputs, Gaussian and then with outlier columns (x20 every 97th: their blocks' steps widen)."""
    generator = torch.Generator().manual_seed(7)
    cols = 2048
    if qtype in ggml_quantize.QUANTIZABLE:
        raw = ggml_quantize.quantize(torch.randn(96, cols, generator=generator) * 0.05, qtype)
    else:
        raw = weight_bytes(qtype, 96, cols, seed=7)
    weights = ggml_blocks.dequantize(raw, qtype, cols).double()
    x = torch.randn(9, cols, generator=generator)
    # Relative RMS error (docs/quantization.md, Accuracy): measured 0.0056 Gaussian (0.0031 for the
    # random Q5_K bytes), 0.011-0.016 with the outliers.
    for scale, relative_rms in ((1.0, 1e-2), (20.0, 2.5e-2)):
        x[:, ::97] *= scale
        out = native_quant.ggml_quant_matmul(x, raw, qtype, cols).double()
        float_path = x.double() @ weights.T
        error = (out - float_path).abs()
        assert (error <= half_step_bound(x, weights) * (1 + 1e-6) + 1e-6).all()
        assert float(error.norm() / float_path.norm()) < relative_rms


def vnni_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, cols: int) -> torch.Tensor:
    """quant_dot.c's kernel itself: on a CPU with AMX, ggml_quant_matmul hands steps of
    ``amx_quant.MIN_ROWS`` rows or more to the int8 tiles (tests/backends/test_native_amx_quant.py)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], raw.shape[0])
    assert native_library.load().quant_matmul(int(qtype), x.data_ptr(), x.shape[0], cols, raw.data_ptr(), raw.shape[0],
                                              raw.shape[1], out.data_ptr()) == 0
    return out


@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
def test_a_row_does_not_depend_on_the_rows_beside_it_or_the_threads(qtype: GGMLQuantizationType) -> None:
    """Bit for bit: each output of each row takes the same operations in the same order whatever the
    tile (4, 2 or 1 outputs; 1..16 rows), the row's place in it, or the thread count."""
    cols = cols_for(qtype, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 5)
    raw = weight_bytes(qtype, 203, cols, seed=11)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(11))
    alone = torch.cat([vnni_matmul(row[None], raw, qtype, cols) for row in x])
    previous = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 3, 4, 5, 16, 17, 40):
                assert torch.equal(vnni_matmul(x[:rows], raw, qtype, cols), alone[:rows])
            shuffled = torch.randperm(40, generator=torch.Generator().manual_seed(count))
            assert torch.equal(vnni_matmul(x[shuffled], raw, qtype, cols), alone[shuffled])
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=[("-mno-avx512f",), ("-mno-avx512f", "-mno-avxvnni")],
                ids=["avx2-vnni", "avx2"])
def avx2_library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """quant_dot.c built without AVX-512 (and without AVX-VNNI): the AVX2 kernels a CPU without
    AVX-512 VNNI runs, tried here on this one (which has AVX2)."""
    if "avx2" not in native_build.cpu_features():
        pytest.skip("this CPU has no AVX2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLUGINFER_CACHE", str(tmp_path_factory.mktemp("avx2")))
        patch.setattr(native_build, "FLAGS", [*native_build.FLAGS, *request.param])
        try:
            library, _, _ = native_build.build_library("quant_dot_avx2", (native_library.SOURCES[0].with_name("quant_dot.c"),))
        except native_build.NativeKernelsUnavailable as exc:
            pytest.skip(f"cannot build the AVX2 variant here: {exc}")
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.quant_matmul.argtypes = [ctypes.c_int, pointer, i64, i64, pointer, i64, i64, pointer]
    library.quant_dot_quantize.argtypes = [pointer, i64, i64, pointer, pointer]
    vnni = "avx_vnni" in native_build.cpu_features() and "-mno-avxvnni" not in request.param
    assert library.quant_dot_supported() == (2 if vnni else 3)
    return library


def avx2_matmul(library: ctypes.CDLL, x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType,
                cols: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], raw.shape[0])
    x = x.contiguous()
    assert library.quant_matmul(int(qtype), x.data_ptr(), x.shape[0], cols, raw.data_ptr(), raw.shape[0],
                                raw.shape[1], out.data_ptr()) == 0
    return out


@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
def test_avx2_kernels_equal_the_int8_reference(avx2_library: ctypes.CDLL, qtype: GGMLQuantizationType) -> None:
    """The same oracle, rows 1..17 (tiles of up to 8 rows, and one of 1 row x 2 outputs), batch
    invariance; Q8_0 with levels of -128 (without VNNI it takes the sign trick)."""
    cols = cols_for(qtype, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 3)
    raw = weight_bytes(qtype, 37, cols, seed=int(qtype) + 1)
    if qtype == T.Q8_0:
        raw.view(37, -1, 34)[2:, :, 2] = 0x80
    weights = ggml_blocks.dequantize(raw, qtype, cols).double()
    x = torch.randn(17, cols, generator=torch.Generator().manual_seed(int(qtype)))
    alone = torch.cat([avx2_matmul(avx2_library, row[None], raw, qtype, cols) for row in x])
    for rows in range(1, 18):
        out = avx2_matmul(avx2_library, x[:rows], raw, qtype, cols)
        assert_exact_oracle(out, x[:rows], weights)
        assert torch.equal(out, alone[:rows])
    levels = torch.empty(17, cols, dtype=torch.int8)
    scales = torch.empty(17, cols // 32)
    x[3, 5] = float("nan")
    assert avx2_library.quant_dot_quantize(x.data_ptr(), 17, cols, levels.data_ptr(), scales.data_ptr()) == 0
    expected_levels, expected_scales = ggml_blocks.quantize_activations(x)
    assert torch.equal(levels, expected_levels) and torch.equal(scales.nan_to_num(-1), expected_scales.nan_to_num(-1))


def test_activation_quantization_is_the_torch_reference_bit_for_bit() -> None:
    """Scales and levels, with ties (x * 127 / max exactly k + 0.5), zeros, subnormal and huge
    blocks, NaN and infinities."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 320, generator=generator) * torch.logspace(-38, 38, 64)[:, None]
    x[0] = torch.randint(-254, 255, (320,), generator=generator).float() / 2 * (3.0 / 127)  # .5 ties
    x[1, :32] = 0.0
    x[1, 32:64] = -0.0
    x[2, :32] = 1e-38  # 127 / max|x| overflows: zeros, scale 0
    x[3, 5], x[3, 40], x[3, 100] = float("nan"), float("inf"), -float("inf")
    x[4] = torch.finfo(torch.float32).max * torch.rand(320, generator=generator)
    levels, scales = native_quant.quantize_activations(x)
    expected_levels, expected_scales = ggml_blocks.quantize_activations(x)
    assert torch.equal(levels, expected_levels)
    assert torch.equal(scales.isnan(), expected_scales.isnan())
    assert torch.equal(scales[~scales.isnan()], expected_scales[~expected_scales.isnan()])
    assert levels.abs().max() == 127 and (levels[0] != 0).any()
    assert (scales[1, :2] == 0).all() and (levels[1, :64] == 0).all()
    assert scales[2, 0] == 0 and (levels[2, :32] == 0).all()
    assert scales[3, :4].isnan().tolist() == [True, True, False, True] and (levels[3, :64] == 0).all()


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_nan_and_inf(qtype: GGMLQuantizationType) -> None:
    """A row with a NaN or an infinity gives NaN in every output (the float path gives NaN or ±Inf);
    other rows are untouched. A weight row with a NaN scale gives NaN in that output of every row,
    as the float path does."""
    cols = cols_for(qtype, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 4)
    raw = weight_bytes(qtype, 21, cols, seed=5)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(5))
    clean = native_quant.ggml_quant_matmul(x, raw, qtype, cols)
    x[1, 3], x[2, 70], x[3, 0] = float("nan"), float("inf"), -float("inf")
    out = native_quant.ggml_quant_matmul(x, raw, qtype, cols)
    assert out[1:4].isnan().all()
    assert torch.equal(out[[0, 4]], clean[[0, 4]])

    poisoned = raw.clone()
    poisoned.view(21, -1, GGML_QUANT_SIZES[qtype][1])[7, 0, FP16_FIELDS[qtype][0] + 1] = 0x7E  # fp16 NaN
    out = native_quant.ggml_quant_matmul(x[[0, 4]], poisoned, qtype, cols)
    # (two rows: the same kernel as for two clean rows; five may take the AMX tiles, whose sums round apart)
    clean = native_quant.ggml_quant_matmul(x[[0, 4]], raw, qtype, cols)
    assert out[:, 7].isnan().all() and torch.equal(out[:, :7], clean[:, :7])


def test_declined_inputs_and_errors() -> None:
    raw = weight_bytes(T.Q4_0, 8, 64, seed=1)
    x = torch.randn(2, 64)
    assert native_quant.ggml_quant_matmul(x, weight_bytes(T.Q2_K, 8, 256, seed=1), T.Q2_K, 256) is None  # no kernel
    assert native_quant.ggml_quant_matmul(torch.randn(2, 256), torch.zeros(8, 512, dtype=torch.uint8), T.F16, 256) is None
    assert native_quant.ggml_quant_matmul(x, raw[:, :18], T.Q4_0, 32) is None  # strided rows
    assert native_quant.ggml_quant_matmul(x, raw, T.Q4_0, 32) is None  # x does not have the columns
    with pytest.raises(ValueError, match="status -2"):
        native_quant.ggml_quant_matmul(torch.randn(2, 96), raw, T.Q4_0, 96)  # 96 columns are not rows of 36 bytes
    assert native_quant.ggml_quant_matmul(torch.randn(0, 64), raw, T.Q4_0, 64).shape == (0, 8)
    # Leading dims and half-precision inputs (computed in float32, returned in the input's dtype).
    out = native_quant.ggml_quant_matmul(torch.randn(2, 3, 64).bfloat16(), raw, T.Q4_0, 64)
    assert out.shape == (2, 3, 8) and out.dtype == torch.bfloat16


@pytest.fixture
def fresh_logs() -> Iterator[None]:
    native_library._logged.clear()
    yield
    native_library._logged.clear()


def test_ggml_linear_takes_the_fused_kernel_at_every_row_count_with_float32_tiles(monkeypatch: pytest.MonkeyPatch,
                                                                      fresh_logs: None) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv(native_quant.QUANT_TILES_ENV, "float32")  # bfloat16 tiles past the threshold: test_bf16_tiles.py
    kernel = native.op("ggml_dequantize")
    assert isinstance(kernel, native_quant.GGMLDequantize) and kernel.quant_matmul is native_quant.ggml_quant_matmul
    assert native.op("ggml_quant_matmul") is native_quant.ggml_quant_matmul
    cols, limit = 256, ggml_blocks.QUANT_MATMUL_MAX_ROWS
    # with float32 tiles the panel GEMM takes every row count (Q8_0 on AVX2 without AVX-VNNI up to 128)
    assert kernel.quant_matmul_max_rows == {
        qtype: native_quant.AVX2_Q8_0_MAX_ROWS if qtype == 8 and native_quant.quant_dot_isa() == "AVX2"
        else native_quant.PANEL_MAX_ROWS for qtype in native_quant.QUANT_MATMUL_TYPES}
    raw = weight_bytes(T.Q4_K, 600, cols, seed=2)  # two tiles of the dequantizing path
    weights = ggml_blocks.dequantize(raw, T.Q4_K, cols)
    bias = torch.randn(600)
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, cols)
        out = ggml_blocks.ggml_linear(x, raw, T.Q4_K, cols, bias, kernel)
        plain = ggml_blocks.ggml_linear(x, raw, T.Q4_K, cols, bias, native_quant.ggml_dequantize)
        assert torch.equal(out, native_quant.ggml_quant_matmul(x, raw, T.Q4_K, cols) + bias)
        assert not torch.equal(out, plain)
        torch.testing.assert_close(plain, F.linear(x, weights, bias), atol=1e-4, rtol=1e-4)
    # Types without a fused kernel keep the dequantizing path.
    raw = weight_bytes(T.Q3_K, 40, cols, seed=2)
    x = torch.randn(3, cols)
    assert torch.equal(ggml_blocks.ggml_linear(x, raw, T.Q3_K, cols, None, kernel),
                       ggml_blocks.ggml_linear(x, raw, T.Q3_K, cols, None, native_quant.ggml_dequantize))


def test_float_activations_by_environment_and_the_fallback_log_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_logs: None) -> None:
    caplog.set_level(logging.INFO, logger=native_library.__name__)
    monkeypatch.setenv(ENV, "float")
    assert native.op("ggml_dequantize") is native_quant.ggml_dequantize and native.op("ggml_quant_matmul") is None
    native.op("ggml_dequantize")
    assert [r.getMessage() for r in caplog.records] == [
        "quantized linears: PLUGINFER_QUANT_ACTIVATIONS=float, float32 activations against dequantized tiles"]
    monkeypatch.setenv(ENV, "int4")
    with pytest.raises(ValueError, match="PLUGINFER_QUANT_ACTIVATIONS='int4'"):
        native.op("ggml_dequantize")

    # A CPU without AVX2: the dequantizing path, said once as a warning.
    caplog.clear()
    monkeypatch.setenv(ENV, "int8")
    monkeypatch.setenv(native_quant.QUANT_TILES_ENV, "float32")  # else, on AMX, an op carrying bfloat16 tiles
    monkeypatch.setattr(native_quant, "quant_dot_supported", lambda: False)
    assert native.op("ggml_dequantize") is native_quant.ggml_dequantize and native.op("ggml_quant_matmul") is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.levelname == "WARNING"] == [
        ("WARNING", "quantized linears: no fused int8-activation kernel for this CPU (it needs AVX2); "
                    "every step dequantizes tiles for a GEMM")]


# A quantized llama small enough to run both paths: every input size a multiple of 256 (K-quants).
K_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def k_llama(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("quant_dot_llama")
    save_hf_model("LlamaForCausalLM", K_LLAMA, out, tiny_tokenizer_dir)
    return out


@pytest.mark.parametrize("quant", ["q4_0", "q8_0", "q4_k"])
def test_quantized_llama_logits_with_int8_and_float_activations(
        quant: str, k_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of 24 and 144 tokens (every linear fused: the few-row tiles, the panel GEMM) stay within the
    stated bound of the float path; greedy tokens match or were near-ties."""
    short, long = random_prompts(200, [24, ggml_blocks.QUANT_MATMUL_MAX_ROWS + 16], seed=4)
    results = {}
    # float32 tiles over the threshold, as the float path's (bfloat16 ones there: test_bf16_tiles.py)
    monkeypatch.setenv(native_quant.QUANT_TILES_ENV, "float32")
    for mode in ("int8", "float"):
        monkeypatch.setenv(ENV, mode)
        llm = LLM(model=str(k_llama), dtype="float32", num_blocks=64, block_size=8, quant=quant)
        layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "qweight")]
        assert layers and all(isinstance(m.ggml_dequantize, native_quant.GGMLDequantize) == (mode == "int8")
                              for m in layers)
        results[mode] = (prefill_logits(llm, short), prefill_logits(llm, long),
                         llm.generate([short], greedy(8))[0].outputs[0].token_ids)
        del llm
    fused, floats = results["int8"], results["float"]
    # Log-probabilities within 0.15 nats: measured 0.057-0.075 for three prompts and these three types
    # (~0.5 % per linear, compounded over two layers of this random model, whose logits' spread is ~0.8).
    for prompt in (0, 1):
        assert float((fused[prompt].log_softmax(-1) - floats[prompt].log_softmax(-1)).abs().max()) < 0.15
    # Greedy continuations (they differ for some prompts): up to the first difference they are the
    # same tokens, and the fused path's token there was a near-tie (within 0.15 nats) for the float path.
    if fused[2] != floats[2]:
        first = next(i for i, (a, b) in enumerate(zip(fused[2], floats[2], strict=True)) if a != b)
        monkeypatch.setenv(ENV, "float")
        llm = LLM(model=str(k_llama), dtype="float32", num_blocks=64, block_size=8, quant=quant)
        logprobs = prefill_logits(llm, short + fused[2][:first])[-1].log_softmax(-1)
        assert float(logprobs.max() - logprobs[fused[2][first]]) < 0.15
