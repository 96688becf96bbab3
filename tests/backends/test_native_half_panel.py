"""The 16-bit panel GEMM (``csrc/half_panel.c``, ops ``ggml_half_pack`` / ``ggml_half_linear``): float32 activations
against a bfloat16/float16 weight packed at load into panels, a GGUF file's F16/BF16 tensors in a float32 model
on a CPU without AMX (AVX-512, or AVX2 with FMA and F16C: the same bits).

The bound is half_weight_linear's (test_native_half_weight_linear.py): widening is exact and each output is one
chain of fused multiply-adds, so ``|out - exact| <= (k + 2) * 2^-24 * S``. Each output's chain runs over the inputs
in order whatever the tile (AVX-512: 8 x 3 widened in registers, 8 x 3 or 14 x 2 on widened blocks; AVX2: 1-2 rows
x the whole group, 6 rows x a third widened in registers or on widened blocks), so a row's result is the same bits
whatever rows share its call, the thread count or the instruction set.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pluginfer.backends.cpu import amx_half, half_panels, library
from pluginfer.backends.cpu import build as native_build
from pluginfer.backends.cpu import ops as native
from pluginfer.quant import ggml_ops
from tests.backends import half_linear_cases
from tests.backends.half_linear_cases import assert_nonfinite_as_exact, exact, plant_nonfinite

pytestmark = pytest.mark.skipif(native.available() is not None or not half_panels.supported(),
                                reason="the 16-bit panel GEMM needs the native library and AVX2 (FMA, F16C)")

DTYPES = [torch.bfloat16, torch.float16]
# (out, in): fewer outputs than a panel, one group (a tile of 2 panels past it), outputs past whole tiles of 2 and
# 3 panels, inputs past whole blocks of 128 and 256 (and shorter than one), the tiny model's LM head.
SHAPES = [(1, 1), (17, 33), (48, 40), (70, 96), (97, 129), (130, 300), (200, 513), (1001, 96)]
# AVX-512: one group widened in registers (1-8), 8 x 3 on widened blocks (9-48), 14 x 2 above; AVX2: the whole
# group (1-2), thirds of 6 rows widened in registers (3-6), on widened blocks above; a second row block (> 112)
ROWS = [1, 2, 3, 5, 8, 9, 16, 33, 48, 49, 64, 113, 130]

inputs = functools.partial(half_linear_cases.inputs, activations=torch.float32)


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return half_panels.half_panel_linear(x, half_panels.pack_half_panels(weight), weight.shape[0], bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_within_the_float32_bound_of_exact(dtype: torch.dtype, shape: tuple[int, int], set_threads) -> None:
    out_features, in_features = shape
    for threads in (1, 2):
        set_threads(threads)
        for rows in ROWS:
            x, weight, bias = inputs(rows, out_features, in_features, dtype, rows * 13 + threads, rows % 2 == 0)
            out = run(x, weight, bias)
            assert out.dtype == torch.float32 and out.shape == (rows, out_features)
            value, size = exact(x, weight, bias)
            assert ((out.double() - value).abs() <= (in_features + 2) * 2.0**-24 * size).all(), (rows, threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_result_does_not_depend_on_its_batch_or_threads(dtype: torch.dtype, set_threads) -> None:
    """Every row count of the three tile kinds and two row blocks, the rows shuffled, 1 and 2 threads."""
    rows = 130
    x, weight, bias = inputs(rows, 101, 300, dtype, 5, True)
    packed = half_panels.pack_half_panels(weight)
    set_threads(1)
    alone = torch.cat([half_panels.half_panel_linear(x[r:r + 1], packed, 101, bias) for r in range(rows)])
    for threads in (1, 2):
        set_threads(threads)
        for batch in ROWS:
            assert torch.equal(half_panels.half_panel_linear(x[:batch], packed, 101, bias), alone[:batch])
        shuffled = torch.randperm(rows, generator=torch.Generator().manual_seed(threads))
        assert torch.equal(half_panels.half_panel_linear(x[shuffled], packed, 101, bias), alone[shuffled])
    # leading dims are rows too
    assert torch.equal(half_panels.half_panel_linear(x[:16].view(2, 8, 300), packed, 101, bias),
                       alone[:16].view(2, 8, 101))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_ops_against_their_reference(dtype: torch.dtype) -> None:
    """The registered ops hold the reference's contract: the kernel's packing read by its linear gives the
    reference's (the checkpoint's layout, F.linear on the widened weight) within the float32 bound."""
    x, weight, bias = inputs(16, 70, 96, dtype, 3, True)
    reference = ggml_ops.ggml_half_linear(x, ggml_ops.ggml_half_pack(weight), 70, bias)
    packed = half_panels.pack_half_panels(weight)
    assert packed.shape == (96 // 48, 96, 48) and packed.dtype == dtype
    assert torch.equal(packed.transpose(1, 2).reshape(-1, 96)[:70], weight)  # the same values, transposed in groups
    assert not packed.transpose(1, 2).reshape(-1, 96)[70:].any()  # zero rows pad the outputs
    out = half_panels.half_panel_linear(x, packed, 70, bias)
    value, size = exact(x, weight, bias)
    assert ((out.double() - value).abs() <= 98 * 2.0**-24 * size).all()
    assert ((reference.double() - value).abs() <= 98 * 2.0**-24 * size).all()


def test_the_pack_op_keeps_weights_where_amx_tiles_take_them(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(40, 64).half()
    monkeypatch.setattr(amx_half, "library", lambda: None)
    assert half_panels.pack(weight) is not None
    monkeypatch.setattr(amx_half, "library", lambda: object())  # a CPU with AMX-BF16: its tiles read the weight
    assert half_panels.pack(weight) is None
    monkeypatch.setattr(amx_half, "library", lambda: None)
    for other in (weight.float(), weight[None], torch.empty(0, 64, dtype=torch.float16)):
        assert half_panels.pack(other) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_infinity_propagate_as_in_ieee_arithmetic(dtype: torch.dtype) -> None:
    for rows in (3, 16, 64):
        x, weight, _ = inputs(rows, 30, 40, dtype, 7, False)
        plant_nonfinite(x, weight)
        assert_nonfinite_as_exact(run(x, weight, None), exact(x, weight, None)[0])


def test_bad_inputs_are_refused() -> None:
    weight = torch.randn(40, 64).half()
    packed = half_panels.pack_half_panels(weight)
    with pytest.raises(ValueError, match="2-d bfloat16/float16"):
        half_panels.pack_half_panels(weight.float())
    with pytest.raises(ValueError, match="float32 inputs of 64 features"):
        half_panels.half_panel_linear(torch.randn(2, 63), packed, 40)
    with pytest.raises(ValueError, match="float32 inputs"):
        half_panels.half_panel_linear(torch.randn(2, 64).half(), packed, 40)


@pytest.mark.slow
def test_the_avx2_form_gives_the_avx512_forms_bits(tmp_path: Path) -> None:
    """The AVX2 tiles (a CPU without AVX-512) run the same multiply-add chains: the same outputs bit for bit."""
    if library.load().half_panel_supported() != 1 or not {"avx2", "fma", "f16c"} <= native_build.reported_cpu_features():
        pytest.skip("needs this CPU's AVX-512 form here and AVX2 for the other")
    cases = []
    for index, (rows, (out_features, in_features)) in enumerate(zip([1, 2, 3, 16, 130], SHAPES[3:])):
        for dtype in DTYPES:
            x, weight, bias = inputs(rows, out_features, in_features, dtype, 41 + index, index % 2 == 0)
            cases.append((x, weight, bias, run(x, weight, bias)))
    torch.save([case[:3] for case in cases], tmp_path / "cases.pt")
    script = ("import sys, torch\n"
              "from pluginfer.backends.cpu import half_panels\n"
              "cases = torch.load(sys.argv[1])\n"
              "torch.save([half_panels.half_panel_linear(x, half_panels.pack_half_panels(w), w.shape[0], b)\n"
              "            for x, w, b in cases], sys.argv[2])\n")
    env = {**os.environ, native_build.ISA_ENV: "avx2"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")], env=env,
                   check=True, capture_output=True, timeout=900)
    for (_, _, _, expected), got in zip(cases, torch.load(tmp_path / "avx2.pt")):
        assert torch.equal(got, expected)
