"""GGML block formats in torch against their oracles: gguf-py for every dequantization and the legacy
quantizers, llama.cpp's C library (committed fixtures) for the K-quant quantizers."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from pluginfer.quant import ggml_blocks, ggml_quantize
from pluginfer.quant.tiled import TILE_ROWS

T = GGMLQuantizationType
FIXTURES = Path(__file__).parent / "fixtures" / "kquant_fixtures.npz"
# Byte offsets of the fp16 scale/min fields inside one block of each type.
FP16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
               T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
DEQUANTIZED = [T.F32, T.F16, T.BF16, *FP16_FIELDS]
QUANTIZED_LIKE_GGUF = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def raw_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes in the row layout, with edge cases: row 0 all zero, row 1 all 0xff (every
    nibble and bit field at its maximum) with a negative scale, and in rows 2..5 finite random
    fp16 scales, or finite values for the float types (rows further down keep random bytes there:
    NaNs, infinities, subnormals)."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    raw[0] = 0
    raw[1] = 0xFF
    if qtype in (T.F32, T.F16, T.BF16):
        finite = rng.standard_normal((4, cols)).astype(np.float32)
        finite = {T.F32: finite, T.F16: finite.astype(np.float16),
                  T.BF16: (finite.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
        raw[2:6] = finite.view(np.uint8).reshape(4, cols, type_size)
    for offset in FP16_FIELDS.get(qtype, []):
        raw[1, :, offset:offset + 2] = np.array([-0.75], dtype=np.float16).view(np.uint8)
        scales = (rng.standard_normal((4, cols // block)) * 0.1).astype(np.float16)
        raw[2:6, :, offset:offset + 2] = scales.view(np.uint8).reshape(4, -1, 2)
    return raw.reshape(rows, -1)


def assert_same_bits(ours: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit for bit (infinities, subnormals and -0 included), except a NaN's payload: where gguf-py
    has a NaN (a scale field that is NaN), ours is a NaN too, but torch may quiet or canonicalize
    it (numpy keeps an fp16 signaling NaN's payload when widening; torch sets the quiet bit)."""
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.parametrize("qtype", DEQUANTIZED, ids=lambda t: t.name)
def test_dequantize_is_bit_exact_with_gguf(qtype: GGMLQuantizationType) -> None:
    cols = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
    raw = raw_blocks(qtype, rows=9, cols=cols, seed=int(qtype))
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf_quants.dequantize(raw, qtype)
    ours = ggml_blocks.dequantize(torch.from_numpy(raw), qtype, cols)
    assert ours.dtype == torch.float32 and ours.shape == (9, cols)
    assert_same_bits(ours.numpy(), expected)
    assert not np.isnan(expected[[0, 2, 3, 4, 5]]).any()  # the rows with finite scales are checked in full


@pytest.mark.parametrize("qtype", [T.Q4_K, T.F16, T.BF16], ids=lambda t: t.name)
def test_dequantize_to_another_dtype_rounds_the_float32_result(qtype: GGMLQuantizationType) -> None:
    raw = torch.from_numpy(raw_blocks(qtype, rows=6, cols=256, seed=1)[2:6])  # finite rows
    dense = ggml_blocks.dequantize(raw, qtype, 256)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(ggml_blocks.dequantize(raw, int(qtype), 256, dtype), dense.to(dtype))


def edge_case_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator) * torch.rand(rows, 1, generator=generator) * 3
    weight[0, :32] = 0                               # an all-zero block
    weight[0, 32:64] = torch.arange(32) - 15.5       # ties after scaling
    weight[1, :32] = 0.75                            # a constant block
    weight[2, :32] = weight[2, :32].abs() + 0.1      # all positive: the min is above 0
    weight[3, :32] = -weight[3, :32].abs()           # all negative
    weight[4, 7] = 60.0                              # an outlier
    weight[5] *= 1e-7                                # tiny values
    return weight


@pytest.mark.parametrize("qtype", QUANTIZED_LIKE_GGUF, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_is_bit_exact_with_gguf(qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    """No -0.0 here: with signed zeros gguf-py departs from llama.cpp's C, which we follow (the
    fixture test's signed-zero row)."""
    weight = edge_case_weight(8, 256, seed=int(qtype)).to(dtype)
    ours = ggml_quantize.quantize(weight, qtype)
    assert ours.dtype == torch.uint8 and ours.shape == (8, ggml_blocks.row_bytes(qtype, 256))
    expected = gguf_quants.quantize(weight.float().numpy(), qtype)
    np.testing.assert_array_equal(ours.numpy(), expected.view(np.uint8).reshape(ours.shape))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantize_matches_llama_cpp_c_library(name: str) -> None:
    """Bytes from ``ggml_quantize_chunk`` (fixtures/make_kquant_fixtures.py: all-zero, constant,
    all-positive/negative, ramp, outlier, tiny below/above GROUP_MAX_EPS, sparse, large and
    signed-zero rows).
    The C build had no FMA, so the comparison is exact; no tolerance is needed or allowed."""
    fixtures = np.load(FIXTURES)
    ours = ggml_quantize.quantize(torch.from_numpy(fixtures["weight"]), T[name])
    np.testing.assert_array_equal(ours.numpy(), fixtures[name])


@pytest.mark.parametrize("mkl_setting", ["MKL_CBWR=COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS=SSE4_2"])
def test_quantized_bytes_do_not_depend_on_the_math_library_path(mkl_setting: str) -> None:
    """MKL picks its code path by CPU (an AMD CPU gets another than an Intel one), and torch's float32
    ``sqrt`` goes through it: forcing another path here stands in for another CPU."""
    variable, value = mkl_setting.split("=")
    script = ("import numpy as np, torch; from gguf import GGMLQuantizationType as T; from pluginfer.quant import ggml_quantize; "
              f"f = np.load({str(FIXTURES)!r}); "
              "[np.testing.assert_array_equal(ggml_quantize.quantize(torch.from_numpy(f['weight']), getattr(T, t)).numpy(), f[t]) "
              "for t in ('Q4_K', 'Q6_K')]")
    env = {**os.environ, variable: value}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)


def test_fixture_inputs_are_the_scripts() -> None:
    """The committed rows are what make_kquant_fixtures.py generates, so the script documents them."""
    spec = importlib.util.spec_from_file_location("make_kquant_fixtures", FIXTURES.with_name("make_kquant_fixtures.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    fixtures = np.load(FIXTURES)
    np.testing.assert_array_equal(fixtures["weight"], script.fixture_rows())
    assert str(fixtures["llama_cpp_commit"]) == script.LLAMA_CPP_COMMIT


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quant_round_trip_error_is_a_fraction_of_each_sub_block_range(qtype: GGMLQuantizationType) -> None:
    weight = edge_case_weight(16, 512, seed=5)
    restored = ggml_blocks.dequantize(ggml_quantize.quantize(weight, qtype), qtype, 512)
    sub_block = 32 if qtype == T.Q4_K else 16
    levels = 15 if qtype == T.Q4_K else 63
    blocks, restored_blocks = weight.reshape(-1, sub_block), restored.reshape(-1, sub_block)
    span = blocks.amax(dim=1) - blocks.amin(dim=1).clamp(max=0)
    # A step is about span / levels; the search over scales, and 6-bit (Q4_K) or 8-bit (Q6_K)
    # super-block scales, cost at most about one more step.
    error = (restored_blocks - blocks).abs().amax(dim=1)
    assert (error <= 2 * span / levels + 1e-6).all()


def test_row_bytes_and_errors_name_the_type_and_tensor() -> None:
    assert ggml_blocks.row_bytes(T.Q4_K, 512) == 288
    assert ggml_blocks.row_bytes(int(T.Q8_0), 64) == 68
    assert ggml_blocks.row_bytes(T.BF16, 3) == 6
    with pytest.raises(ValueError, match=r"Q4_K.*256.*100"):
        ggml_blocks.row_bytes(T.Q4_K, 100)
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight'.*Q2_K"):
        ggml_quantize.quantize(torch.randn(2, 256), T.Q2_K, name="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match=r"Q6_K.*'w'.*multiple of 256.*\(2, 288\)"):
        ggml_quantize.quantize(torch.randn(2, 288), T.Q6_K, name="w")
    with pytest.raises(ValueError, match=r"IQ2_XXS"):
        ggml_blocks.dequantize(torch.zeros(1, 66, dtype=torch.uint8), T.IQ2_XXS, 256)
    with pytest.raises(ValueError, match=r"Q8_0 rows of 64 weights are 68"):
        ggml_blocks.dequantize(torch.zeros(1, 64, dtype=torch.uint8), T.Q8_0, 64)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_1, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_ggml_linear_dequantizes_one_tile_at_a_time(qtype: GGMLQuantizationType,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rows, cols = 1100, 256  # three tiles of rows, the last one partial
    raw = raw_blocks(qtype, rows, cols, seed=3)
    for offset in FP16_FIELDS.get(qtype, []):  # finite scales in every row: finite weights
        raw.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])[:, :, offset + 1] &= 0x3B
    raw = torch.from_numpy(raw)
    if qtype == T.F16:
        raw = ggml_quantize.quantize(torch.randn(rows, cols), qtype)
    x, bias = torch.randn(3, 4, cols), torch.randn(rows)
    expected = F.linear(x, ggml_blocks.dequantize(raw, qtype, cols), bias)
    assert expected.isfinite().all()

    tiles = []
    dequantize = ggml_blocks.dequantize
    monkeypatch.setattr(ggml_blocks, "dequantize",
                        lambda part, *args: tiles.append(part.shape[0]) or dequantize(part, *args))
    out = ggml_blocks.ggml_linear(x, raw, qtype, cols, bias)
    assert tiles and max(tiles) <= TILE_ROWS and sum(tiles) == rows
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
