"""The kernel tests again under every narrower instruction set this CPU can execute, so one run on an AVX-512 or
AMX machine also covers what a CPU without them runs: ``PLUGINFER_CPU_ISA=avx2`` (the AVX2 builds and the
kernel choices of a CPU without AVX-512, VNNI or AMX) and ``PLUGINFER_AMX=0`` (the AVX-512 paths an AMD Zen 4
takes). Also: a bad value of either variable is an error naming it."""

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
VARIANTS = {"avx2": ({"PLUGINFER_CPU_ISA": "avx2"}, "avx512f"), "no-amx": ({"PLUGINFER_AMX": "0"}, "amx_tile")}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_tests_pass_on_the_narrower_instruction_set(variant: str) -> None:
    setting, needs = VARIANTS[variant]
    if needs not in native_build.reported_cpu_features():
        pytest.skip(f"this CPU has no {needs}: its own run already takes the narrower paths")
    env = {**os.environ, **setting, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *KERNEL_TESTS],
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


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("PLUGINFER_CPU_ISA", "avx3", r"PLUGINFER_CPU_ISA='avx3' is not one of native, avx2"),
    ("PLUGINFER_AMX", "yes", r"PLUGINFER_AMX='yes': expected 1 .* or 0"),
])
def test_a_bad_setting_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
                                             message: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        cpu.build()
