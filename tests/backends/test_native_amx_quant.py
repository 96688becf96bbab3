"""The AMX int8 tile matmul (``backends/amx_quant.py``, ``csrc/amx_quant.c``) against its references.

The exact oracle, as for the VNNI kernel (test_native_quant_dot.py): the activations rounded as the
kernels round them times the weights dequantized by the bit-exact torch dequantizer, in float64. The
tiles' integer block dot products are exact and each output sums its blocks' scaled products in
block order in float32: per block two roundings (``float(I) * dx``, then the fused multiply-add with
``dw``; Q4_K adds its min term, one more fused multiply-add), then nb sequential additions, so the
error is at most ``(2 nb + 4)`` units of 2^-24 of the sum of |products|: the test allows 2^-23 per unit.
Then the kernels' activation quantization bit for bit against quant_dot.c's, shapes that fill no tile
(outputs not a multiple of 16, rows not a multiple of 16), one and two threads, batch invariance
(bit for bit), NaN rows, and the hook in ``native_quant.ggml_quant_matmul``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pluginfer.backends.cpu import amx_quant
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.quant import ggml_blocks, ggml_quantize
from tests.backends.amx import require_amx
from tests.backends.test_native_quant_dot import cols_for, rounded_activations, weight_bytes

T = GGMLQuantizationType
AMX_TYPES = [T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K]


@pytest.fixture(scope="module", autouse=True)
def amx() -> None:
    require_amx(amx_quant.library, {"amx_tile", "amx_int8"}, "AMX-INT8",
                "the AVX-512 VNNI kernel takes every row count", "the AMX kernels")


def assert_within_bound(out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> None:
    """Against float64 ``rounded x @ W.T``, within (2 nb + 4) * 2^-23 of the sum of |products|."""
    xq = rounded_activations(x)
    expected = xq @ weights.T
    scale = xq.abs() @ weights.abs().T
    blocks = x.shape[-1] // 32
    error = (out.double() - expected).abs()
    assert (error <= scale * (2 * blocks + 4) * 2**-23 + 1e-30).all(), float((error / scale.clamp(min=1e-30)).max())


def test_activation_quantization_equals_quant_dot_bit_for_bit() -> None:
    """Gaussian rows, a zero block, a tiny block (127 / max overflows), huge values, NaN and Inf."""
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3)) * 3
    x[1, 32:64] = 0
    x[2, 64:96] = 1e-38
    x[3, :32] *= 1e30
    x[4, 100] = float("nan")
    x[5, 200] = float("inf")
    levels, scales = amx_quant.quantize_activations(x)
    expected_levels, expected_scales = native_quant.quantize_activations(x)
    assert torch.equal(levels, expected_levels)
    assert torch.equal(scales.isnan(), expected_scales.isnan())
    assert torch.equal(scales.nan_to_num(), expected_scales.nan_to_num())


@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=lambda n: f"{n}-thread")
def test_tiles_equal_the_int8_reference(qtype: GGMLQuantizationType, threads: int) -> None:
    """Outputs 5, 37 and 48 (one partial tile, several with a partial one, whole tiles); 3 blocks of 32 or
    2 super-blocks of 256 (odd pair counts); rows 1..17 and 40 (groups of 16 and a partial one)."""
    super_block = GGML_QUANT_SIZES[qtype][0] == 256
    cols = cols_for(qtype, 2 if super_block else 3)
    generator = torch.Generator().manual_seed(int(qtype))
    for outputs in (5, 37, 48):
        raw = weight_bytes(qtype, outputs, cols, seed=int(qtype) + outputs)
        weights = ggml_blocks.dequantize(raw, qtype, cols).double()
        for rows in [*range(1, 18), 40]:
            x = torch.randn(rows, cols, generator=generator)
            out = amx_quant.quant_matmul(x, raw, qtype, cols)
            assert out.shape == (rows, outputs) and out.dtype == torch.float32
            assert_within_bound(out, x, weights)


@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
def test_tiles_agree_with_the_vnni_kernel_on_real_weights(qtype: GGMLQuantizationType) -> None:
    """A quantized Gaussian weight (1024 inputs, 96 outputs): the two kernels multiply the same integers
    and differ only in how float32 sums them; both within the bound, and within 1e-5 relative of each
    other here."""
    generator = torch.Generator().manual_seed(11)
    raw = ggml_quantize.quantize(torch.randn(96, 1024, generator=generator) * 0.05, qtype)
    weights = ggml_blocks.dequantize(raw, qtype, 1024).double()
    x = torch.randn(16, 1024, generator=generator)
    tiles = amx_quant.quant_matmul(x, raw, qtype, 1024)
    vnni = native_library.load().quant_matmul  # the VNNI kernel itself, whatever the hook picks
    out = torch.empty(16, 96)
    assert vnni(int(qtype), x.data_ptr(), 16, 1024, raw.data_ptr(), 96, raw.shape[1], out.data_ptr()) == 0
    assert_within_bound(tiles, x, weights)
    assert_within_bound(out, x, weights)
    assert float((tiles - out).abs().max() / out.abs().max()) < 1e-5


@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=lambda n: f"{n}-thread")
def test_a_row_is_the_same_alone_and_in_any_batch(qtype: GGMLQuantizationType, threads: int) -> None:
    """Each of 40 rows computed alone, in the batch of 16 it falls in and in the whole batch of 40: equal
    bit for bit (its outputs take the same operations in the same order)."""
    cols = cols_for(qtype, 4 if GGML_QUANT_SIZES[qtype][0] == 256 else 8)
    raw = weight_bytes(qtype, 50, cols, seed=5)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(5))
    batch = amx_quant.quant_matmul(x, raw, qtype, cols)
    for start in (0, 16, 32):
        assert torch.equal(amx_quant.quant_matmul(x[start:start + 16], raw, qtype, cols), batch[start:start + 16])
    for row in range(40):
        assert torch.equal(amx_quant.quant_matmul(x[row:row + 1], raw, qtype, cols), batch[row:row + 1])


def test_one_and_two_threads_give_the_same_bits() -> None:
    raw = weight_bytes(T.Q4_K, 300, 512, seed=9)  # 19 tiles of outputs, the last partial
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(9))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx_quant.quant_matmul(x, raw, T.Q4_K, 512)
        torch.set_num_threads(2)
        two = amx_quant.quant_matmul(x, raw, T.Q4_K, 512)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_a_nan_or_inf_activation_makes_only_its_row_nan() -> None:
    raw = weight_bytes(T.Q8_0, 20, 128, seed=1)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    x[1, 3] = float("nan")
    x[3, 70] = float("inf")
    out = amx_quant.quant_matmul(x, raw, T.Q8_0, 128)
    assert out[[1, 3]].isnan().all()
    assert not out[[0, 2, 4]].isnan().any()


def test_bad_shapes_are_errors_and_other_types_are_declined() -> None:
    raw = weight_bytes(T.Q8_0, 4, 64, seed=2)
    with pytest.raises(ValueError, match="status -2"):
        amx_quant.call(int(T.Q8_0), torch.randn(4, 96), 4, 96, raw, torch.empty(4, 4))
    assert amx_quant.quant_matmul(torch.randn(4, 64), weight_bytes(T.Q5_0, 4, 64, seed=2), T.Q5_0, 64) is None


@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
def test_ggml_quant_matmul_takes_the_tiles_from_their_row_count(qtype: GGMLQuantizationType) -> None:
    """Below ``MIN_ROWS`` the VNNI kernel's bits, from it the tiles' bits (bfloat16 input included)."""
    raw = weight_bytes(qtype, 24, 512, seed=4)
    start = amx_quant.MIN_ROWS[int(qtype)]
    for rows in (1, start - 1, start, 16):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        out = native_quant.ggml_quant_matmul(x, raw, qtype, 512)
        if rows >= start:
            assert torch.equal(out, amx_quant.quant_matmul(x, raw, qtype, 512))
        else:
            vnni = torch.empty(rows, 24)
            native_library.load().quant_matmul(int(qtype), x.data_ptr(), rows, 512, raw.data_ptr(), 24, raw.shape[1],
                                               vnni.data_ptr())
            assert torch.equal(out, vnni)
    x = torch.randn(2, 8, 512, dtype=torch.bfloat16)
    out = native_quant.ggml_quant_matmul(x, raw, qtype, 512)
    assert out.shape == (2, 8, 24) and out.dtype == torch.bfloat16
    assert torch.equal(out, amx_quant.quant_matmul(x.float(), raw, qtype, 512).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
def test_a_row_alone_and_in_a_batch_of_16_differ_only_by_float32_sums(qtype: GGMLQuantizationType) -> None:
    """Through ``native_quant.ggml_quant_matmul`` a row alone takes the VNNI kernel and in a batch of 16 the
    tiles: not the same bits (the kernels group the float32 sums differently), but both within the
    float32 bound of the same int8 oracle, so within twice it of each other."""
    cols = 1024
    raw = ggml_quantize.quantize(torch.randn(40, cols, generator=torch.Generator().manual_seed(6)) * 0.05, qtype)
    weights = ggml_blocks.dequantize(raw, qtype, cols).double()
    x = torch.randn(16, cols, generator=torch.Generator().manual_seed(6))
    batch = native_quant.ggml_quant_matmul(x, raw, qtype, cols)
    alone = torch.cat([native_quant.ggml_quant_matmul(x[row:row + 1], raw, qtype, cols) for row in range(16)])
    assert torch.equal(batch, amx_quant.quant_matmul(x, raw, qtype, cols))
    assert_within_bound(batch, x, weights)
    assert_within_bound(alone, x, weights)


def test_the_tiles_and_torchs_bfloat16_gemm_take_turns_in_one_thread() -> None:
    """oneDNN's bfloat16 GEMM runs on AMX tiles too on this CPU (the prefill path past the fused rows): each
    side loads its own tile configuration per call, so interleaving them changes neither's results."""
    generator = torch.Generator().manual_seed(8)
    a, b = torch.randn(256, 512, generator=generator).bfloat16(), torch.randn(384, 512, generator=generator).bfloat16()
    raw = weight_bytes(T.Q4_K, 40, 512, seed=8)
    x = torch.randn(16, 512, generator=generator)
    gemm, tiles = torch.nn.functional.linear(a, b), amx_quant.quant_matmul(x, raw, T.Q4_K, 512)
    for _ in range(3):
        assert torch.equal(amx_quant.quant_matmul(x, raw, T.Q4_K, 512), tiles)
        assert torch.equal(torch.nn.functional.linear(a, b), gemm)


def test_pluginfer_amx_0_keeps_the_vnni_kernel_and_says_so() -> None:
    script = ("import logging, torch; logging.basicConfig(level=logging.INFO)\n"
              "from pluginfer.backends.cpu import amx_quant, ops as native\n"
              "assert amx_quant.library() is None and not amx_quant.takes(8, 16)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, amx_quant.ENV: "0"})
    assert result.returncode == 0, result.stderr
    assert "no AMX int8 tiles (PLUGINFER_AMX=0)" in result.stderr
