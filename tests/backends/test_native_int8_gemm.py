"""The cpu backend's W8A8 int8 GEMM (``csrc/int8_gemm.c``) against the ops' torch references, bit for bit: int32
sums are exact, and the float epilogue is the reference's operations in its order. Every variant this CPU can
execute is built from the same source and checked (AVX-512 VNNI, AVX-VNNI, AVX2, portable C)."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pluginfer.backends.cpu import build, int8_gemm
from pluginfer.quant.compressed_tensors import quantize_rows, w8a8_linear

# name -> (compiler flags, the CPU features it needs, int8_gemm_isa()'s answer)
VARIANTS = {
    "avx512-vnni": (["-march=x86-64-v4", "-mavx512vnni"], {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, 3),
    "avx-vnni": (["-march=x86-64-v3", "-mavxvnni"], {"avx2", "fma", "avx_vnni"}, 2),
    "avx2": (["-march=x86-64-v3"], {"avx2", "fma"}, 1),
    "portable": (["-march=x86-64"] if platform.machine() in ("x86_64", "AMD64") else [], set(), 0),
}
SHAPES = [(1, 37, 13), (2, 16, 4), (7, 100, 64), (13, 33, 130), (1, 896, 4864), (200, 70, 257), (97, 130, 1000)]


@pytest.fixture(scope="module")
def native() -> ctypes.CDLL:
    library = int8_gemm.load()
    if library is None:
        pytest.skip("native kernels: the W8A8 int8 GEMM did not build here")
    return library


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    qweight[0, : min(k, 8)] = -128  # the extremes, against -128 levels of x
    x = torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 4
    x[0, 0] = -x[0].abs().max() * 1.5  # a row whose most negative element takes level -128
    if m > 3:
        x[3] = 0  # an all-zero row: scale 0
    return x, qweight, torch.rand(n, generator=generator) * 0.01, torch.randn(n, generator=generator)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_matches_the_reference_bit_for_bit(native: ctypes.CDLL, m: int, n: int, k: int) -> None:
    x, qweight, scale, bias = _case(m, n, k)
    packed = int8_gemm.w8a8_pack(qweight)
    for b in (None, bias):
        out = int8_gemm.w8a8_linear(x, packed, scale, b, n)
        assert torch.equal(out, w8a8_linear(x, qweight, scale, b, n))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_and_leading_dims(native: ctypes.CDLL, dtype: torch.dtype) -> None:
    x, qweight, scale, bias = _case(6, 40, 72)
    x = x.to(dtype).view(2, 3, 72)
    out = int8_gemm.w8a8_linear(x, int8_gemm.w8a8_pack(qweight), scale, bias.to(dtype), 40)
    assert out.dtype == dtype and out.shape == (2, 3, 40)
    assert torch.equal(out, w8a8_linear(x, qweight, scale, bias.to(dtype), 40))


def test_sums_stay_exact_at_the_largest_inputs(native: ctypes.CDLL) -> None:
    k = int8_gemm.MAX_INPUTS
    qweight = torch.full((17, k), -128, dtype=torch.int8)
    qweight[1] = 127
    x = -torch.ones(2, k)  # every level -128: sums of 2^30 in magnitude
    x[1, ::2] = 1
    scale = torch.ones(17)
    assert torch.equal(int8_gemm.w8a8_linear(x, int8_gemm.w8a8_pack(qweight), scale, None, 17),
                       w8a8_linear(x, qweight, scale, None, 17))
    with pytest.raises(ValueError, match="w8a8_pack: needs int8"):
        int8_gemm.w8a8_pack(torch.zeros(2, k + 1, dtype=torch.int8))


def test_activation_quantization_equals_the_reference(native: ctypes.CDLL) -> None:
    x = _case(9, 1, 301)[0]
    levels, scales = int8_gemm.quantize_rows(x)
    expected_levels, expected_scales = quantize_rows(x)
    assert torch.equal(levels, expected_levels) and torch.equal(scales, expected_scales)
    assert levels[0].min().item() == -128 and levels[3].eq(0).all()


def test_non_finite_rows_give_nan_outputs_and_leave_other_rows_alone(native: ctypes.CDLL) -> None:
    x, qweight, scale, bias = _case(4, 20, 50)
    x[1, 7], x[2, 3] = float("nan"), float("inf")
    out = int8_gemm.w8a8_linear(x, int8_gemm.w8a8_pack(qweight), scale, bias, 20)
    assert out[1:3].isnan().all()
    assert torch.equal(out[[0, 3]], w8a8_linear(x[[0, 3]], qweight, scale, bias, 20))


def test_packed_weights_of_another_shape_are_refused(native: ctypes.CDLL) -> None:
    packed = int8_gemm.w8a8_pack(torch.zeros(32, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="not 32 outputs of 68 inputs"):
        int8_gemm.w8a8_linear(torch.zeros(1, 68), packed, torch.ones(32), None, 32)


@pytest.mark.slow  # a compile per variant
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_this_cpu_runs(variant: str, tmp_path: Path) -> None:
    flags, needs, isa = VARIANTS[variant]
    missing = needs - build.reported_cpu_features()
    if missing:
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))}")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    target = tmp_path / f"int8_gemm_{variant}.so"
    result = subprocess.run([compiler, *flags, "-O3", "-shared", "-fPIC", "-std=c11", "-fopenmp",
                             *map(str, int8_gemm.SOURCES), "-o", str(target), "-lm"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    library = ctypes.CDLL(str(target))
    for name, (restype, argtypes) in int8_gemm.SIGNATURES.items():
        getattr(library, name).restype, getattr(library, name).argtypes = restype, argtypes
    assert library.int8_gemm_isa() == isa
    for m, n, k in SHAPES[:4] + [(31, 50, 999)]:
        x, qweight, scale, bias = _case(m, n, k, seed=m)
        packed = torch.empty(library.int8_gemm_packed_bytes(n, k), dtype=torch.int8)
        library.int8_gemm_pack(qweight.data_ptr(), n, k, packed.data_ptr())
        out = torch.empty(m, n)
        assert library.int8_gemm(x.data_ptr(), m, k, packed.data_ptr(), n, scale.data_ptr(), bias.data_ptr(),
                                 out.data_ptr()) == 0
        assert torch.equal(out, w8a8_linear(x, qweight, scale, bias, n)), (variant, m, n, k)
