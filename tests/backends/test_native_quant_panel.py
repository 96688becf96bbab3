"""The many-row int8 GEMM of the fused quantized matmul without AMX (``csrc/quant_panel.h`` with its AVX-512
VNNI and AVX2 forms) against the torch reference: the activations rounded as the kernel rounds them
(``ggml_blocks.quantize_activations``) times the weights dequantized by the bit-exact torch dequantizer, in
float64. Then batch invariance, the routing of ``ggml_quant_matmul`` with ``PLUGINFER_AMX=0`` and with AMX, NaN
rows, the float path's bound on real quantized weights, and the AVX2 forms (built here without AVX-512, with
and without AVX-VNNI) against the same oracle and, bit for bit, the AVX-512 form.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pluginfer.backends.cpu import amx_quant
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.quant import ggml_blocks, ggml_quantize
from tests.backends import test_native_quant_dot as quant_dot_tests
from tests.backends.test_native_quant_dot import (
    FUSED,
    assert_exact_oracle,
    cols_for,
    half_step_bound,
    weight_bytes,
)

T = GGMLQuantizationType
avx2_library = quant_dot_tests.avx2_library  # the fixture: quant_dot.c built without AVX-512


@pytest.fixture(scope="module", autouse=True)
def panel_kernel() -> None:
    reason = native.available()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")
    if not native_quant.quant_dot_supported():
        pytest.skip("the panel GEMM needs AVX2 (the dequantizing path runs instead)")


def panel_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, cols: int,
                 library: ctypes.CDLL | None = None) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape[0], raw.shape[0])
    assert (library or native_library.load()).quant_panel_matmul(
        int(qtype), x.data_ptr(), x.shape[0], cols, raw.data_ptr(), raw.shape[0], raw.shape[1], out.data_ptr()) == 0
    return out


def shapes(qtype: GGMLQuantizationType) -> list[int]:
    """Blocks per row: an odd count of blocks of 32 (a unit's second block absent), and more than one chunk
    of 1024 inputs (33 blocks; 5 super-blocks of 256) whose partial sums carry over in the output."""
    return [1, 2, 5] if GGML_QUANT_SIZES[qtype][0] == 256 else [3, 8, 33]


@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2], indirect=True, ids=lambda n: f"{n}-thread")
def test_panel_equals_the_int8_reference(qtype: GGMLQuantizationType, threads: int) -> None:
    """Outputs 37 and 70 (a panel of 32 columns and a partial one; 5 and 6 columns past the last whole
    panel, in either half), rows 1..33 (tiles of 4 rows and every remainder)."""
    generator = torch.Generator().manual_seed(int(qtype))
    for blocks in shapes(qtype):
        cols = cols_for(qtype, blocks)
        for outputs in (37, 70):
            raw = weight_bytes(qtype, outputs, cols, seed=int(qtype) + blocks)
            weights = ggml_blocks.dequantize(raw, qtype, cols).double()
            for rows in (*range(1, 10), 16, 17, 31, 33):
                x = torch.randn(rows, cols, generator=generator)
                assert_exact_oracle(panel_matmul(x, raw, qtype, cols), x, weights)


@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
def test_a_row_does_not_depend_on_the_rows_beside_it_or_the_threads(qtype: GGMLQuantizationType) -> None:
    """Bit for bit: each output of each row takes the same operations whatever the rows, the tile or the
    thread count."""
    cols = cols_for(qtype, shapes(qtype)[-1])
    raw = weight_bytes(qtype, 101, cols, seed=12)
    x = torch.randn(23, cols, generator=torch.Generator().manual_seed(12))
    alone = torch.cat([panel_matmul(row[None], raw, qtype, cols) for row in x])
    previous = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 5, 8, 23):
                assert torch.equal(panel_matmul(x[:rows], raw, qtype, cols), alone[:rows])
            shuffled = torch.randperm(23, generator=torch.Generator().manual_seed(count))
            assert torch.equal(panel_matmul(x[shuffled], raw, qtype, cols), alone[shuffled])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("amx", [False, True], ids=["PLUGINFER_AMX=0", "AMX"])
def test_ggml_quant_matmul_takes_the_panel_from_its_row_threshold(amx: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AMX tiles every type takes the panel from ``panel_min_rows()`` rows (quant_dot.c's tiles below);
    with them, the types the tiles take keep their path unchanged (quant_dot.c's tiles below
    ``amx_quant.MIN_ROWS``), the others take the panel."""
    if amx and amx_quant.library() is None:
        pytest.skip("this CPU (or PLUGINFER_AMX=0) has no AMX int8 tiles")
    if not amx:
        monkeypatch.setenv(amx_quant.ENV, "0")
        monkeypatch.setattr(amx_quant, "_library", [None])  # as a process started with PLUGINFER_AMX=0 has it
    for qtype in FUSED:
        cols = cols_for(qtype, shapes(qtype)[1])
        raw = weight_bytes(qtype, 45, cols, seed=3)
        weights = ggml_blocks.dequantize(raw, qtype, cols).double()
        threshold = native_quant.panel_min_rows()[int(qtype)]
        for rows in (1, threshold - 1, threshold, 33):
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
            out = native_quant.ggml_quant_matmul(x, raw, qtype, cols)
            assert_exact_oracle(out, x, weights)
            panel = rows >= threshold and not amx_quant.takes(int(qtype), 1 << 61)  # AMX types: as before
            if panel:
                assert torch.equal(out, panel_matmul(x, raw, qtype, cols))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_nan_rows_and_the_float_paths_bound(qtype: GGMLQuantizationType) -> None:
    """A row with a NaN or an infinity is NaN in every output, the others untouched; on real quantized
    weights the result stays within half an activation step of ``x @ dequantize(W).T``."""
    cols = 1024
    generator = torch.Generator().manual_seed(9)
    raw = ggml_quantize.quantize(torch.randn(40, cols, generator=generator) * 0.05, qtype)
    weights = ggml_blocks.dequantize(raw, qtype, cols).double()
    x = torch.randn(12, cols, generator=generator)
    clean = panel_matmul(x, raw, qtype, cols)
    error = (clean.double() - x.double() @ weights.T).abs()
    assert (error <= half_step_bound(x, weights) * (1 + 1e-6) + 1e-6).all()
    x[1, 3], x[2, 700], x[3, 0] = float("nan"), float("inf"), -float("inf")
    out = panel_matmul(x, raw, qtype, cols)
    assert out[1:4].isnan().all() and torch.equal(out[[0, *range(4, 12)]], clean[[0, *range(4, 12)]])


@pytest.mark.parametrize("qtype", FUSED, ids=lambda t: t.name)
def test_avx2_panel_equals_the_int8_reference_and_the_avx512_panel(avx2_library: ctypes.CDLL,
                                                                   qtype: GGMLQuantizationType) -> None:
    """quant_panel_avx2.h: the exact oracle and batch invariance for rows 1..9, 16 and 17 (tiles of 4 rows and
    every remainder), outputs 37 and 70 (panels of 8 and a partial one), more than one chunk; Q8_0 with levels
    of -128 (without AVX-VNNI it takes the sign trick). Its integer sums are exact and its float operations
    those of the AVX-512 form, so where this CPU runs that form the outputs are the same bits."""
    avx2_library.quant_panel_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    generator = torch.Generator().manual_seed(int(qtype) + 100)
    avx512 = native_quant.quant_dot_isa() == "AVX-512 VNNI"
    for blocks in shapes(qtype)[1:]:
        cols = cols_for(qtype, blocks)
        for outputs in (37, 70):
            raw = weight_bytes(qtype, outputs, cols, seed=int(qtype) + blocks)
            if qtype == T.Q8_0:
                raw.view(outputs, -1, 34)[2:, :, 2] = 0x80
            weights = ggml_blocks.dequantize(raw, qtype, cols).double()
            x = torch.randn(17, cols, generator=generator)
            alone = torch.cat([panel_matmul(row[None], raw, qtype, cols, avx2_library) for row in x])
            for rows in (*range(1, 10), 16, 17):
                out = panel_matmul(x[:rows], raw, qtype, cols, avx2_library)
                assert_exact_oracle(out, x[:rows], weights)
                assert torch.equal(out, alone[:rows])
                if avx512:
                    assert torch.equal(out, panel_matmul(x[:rows], raw, qtype, cols))
