"""The kernel tests again under every narrower instruction set this CPU can execute, so one run on an AVX-512 or
AMX machine also covers what a CPU without them runs: ``PLUGINFER_CPU_ISA=avx2`` (the AVX2 builds and the
kernel choices of a CPU without AVX-512, VNNI or AMX), ``PLUGINFER_CPU_ISA=avx2-vnni`` (an Intel Alder Lake's
choices between the int8 kernels) and ``PLUGINFER_CPU_ISA=zen4`` (an AMD Zen 4's build and AVX-512 paths, with oneDNN
and MKL on the instructions they pick there). Also: a bad value of either variable is an error naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pluginfer.backends.cpu import backend as cpu
from pluginfer.backends.cpu import build as native_build

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "backends").glob("test_native_*.py")) + [
    "tests/backends/test_cpu_ops.py",
    "tests/backends/test_cpu_attention.py", "tests/backends/test_cpu_latent_attention.py",
    "tests/backends/test_cpu_step_replay.py", "tests/backends/test_cpu_step_recorder.py",
    "tests/backends/test_bf16_tiles.py", "tests/backends/test_half_linear_engine.py",
    "tests/backends/test_amx_library.py"]
# AVX-VNNI changes only the int8 kernels, whose tests build their AVX-VNNI forms themselves: here, the engine's
# choice of kernel by rows for such a CPU
AVX_VNNI_TESTS = ["tests/backends/test_native_quant_panel.py"]
# each: (environment, what the CPU must have to run it, what makes it narrower than this CPU's own run, its tests)
VARIANTS = {
    "avx2": ({"PLUGINFER_CPU_ISA": "avx2"}, {"avx2", "fma", "f16c"}, "avx512f", KERNEL_TESTS),
    "avx2-vnni": ({"PLUGINFER_CPU_ISA": "avx2-vnni"}, {"avx2", "fma", "f16c", "avx_vnni"}, "avx512f", AVX_VNNI_TESTS),
    # MKL takes its AVX2 GEMMs on an AMD CPU, whose float32 sums round otherwise than its AVX-512 ones
    "zen4": ({"PLUGINFER_CPU_ISA": "zen4", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
             native_build.ZEN4_FEATURES, "amx_tile", KERNEL_TESTS),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_tests_pass_on_the_narrower_instruction_set(variant: str) -> None:
    setting, needs, beyond, tests = VARIANTS[variant]
    reported = native_build.reported_cpu_features()
    if beyond not in reported:
        pytest.skip(f"this CPU has no {beyond}: its own run already takes the narrower paths")
    if not needs <= reported:
        pytest.skip(f"this CPU cannot run the {variant} build: it lacks {', '.join(sorted(needs - reported))}")
    env = {**os.environ, **setting, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1]


def test_the_avx2_variant_hides_what_a_cpu_without_avx512_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    if "avx2" not in native_build.reported_cpu_features():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv(native_build.ISA_ENV, "avx2")
    features = native_build.cpu_features()
    assert "avx2" in features and "fma" in features
    assert not any(f.startswith(("avx512", "amx", "avx_vnni")) for f in features)


def test_the_avx2_vnni_variant_keeps_avx_vnni_and_hides_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    if not {"avx2", "fma", "f16c", "avx_vnni"} <= native_build.reported_cpu_features():
        pytest.skip("this CPU has no AVX-VNNI")
    monkeypatch.setenv(native_build.ISA_ENV, "avx2-vnni")
    features = native_build.cpu_features()
    assert {"avx2", "fma", "avx_vnni"} <= features
    assert not any(f.startswith(("avx512", "amx")) for f in features)


def test_the_avx2_vnni_variant_on_a_cpu_without_it_is_an_error_naming_what_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_build, "reported_cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv(native_build.ISA_ENV, "avx2-vnni")
    with pytest.raises(ValueError, match=r"PLUGINFER_CPU_ISA=avx2-vnni needs AVX-VNNI, which this CPU lacks"):
        native_build.isa()


def test_the_zen4_variant_hides_what_an_amd_zen_4_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    if not native_build.ZEN4_FEATURES <= native_build.reported_cpu_features():
        pytest.skip("this CPU lacks part of Zen 4's AVX-512")
    monkeypatch.setenv(native_build.ISA_ENV, "zen4")
    features = native_build.cpu_features()
    assert native_build.ZEN4_FEATURES <= features
    assert not any(f.startswith(("amx", "avx512_fp16", "avx_vnni")) for f in features)


def test_the_zen4_variant_on_a_cpu_without_it_is_an_error_naming_what_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_build, "reported_cpu_features", lambda: frozenset({"avx2", "fma", "f16c", "avx512f"}))
    monkeypatch.setenv(native_build.ISA_ENV, "zen4")
    with pytest.raises(ValueError, match=r"PLUGINFER_CPU_ISA=zen4 needs what an AMD Zen 4 has; this CPU lacks .*avx512_bf16"):
        native_build.isa()


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("PLUGINFER_CPU_ISA", "avx3", r"PLUGINFER_CPU_ISA='avx3' is not one of native, avx2, avx2-vnni, zen4"),
    ("PLUGINFER_AMX", "yes", r"PLUGINFER_AMX='yes': expected 1 .* or 0"),
])
def test_a_bad_setting_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
                                             message: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        cpu.build()
