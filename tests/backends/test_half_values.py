"""The float16 / bfloat16 conversions every 16-bit kernel shares (``csrc/half_values.h``) give the same bits on each
path the header has: F16C on x86, ``fcvt``/NEON on ARM (aarch64) and the portable software conversion of any
other CPU. ``half_values_probe.c`` widens every 16-bit pattern (one at a time and by whole rows) and rounds a
spread of floats to float16; its output from each build must equal the software build's, and the widened finite
values torch's own conversion. The ARM build runs under qemu where a cross compiler and qemu-user are installed
(``apt-get install gcc-aarch64-linux-gnu qemu-user``)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pluginfer.backends.cpu import build as native_build
from pluginfer.backends.cpu import int8_gemm, library

HERE = Path(__file__).resolve().parent
PROBE = HERE / "half_values_probe.c"
CSRC = HERE.parents[1] / "pluginfer" / "backends" / "cpu" / "csrc"
ON_X86 = platform.machine() in ("x86_64", "AMD64")
HOST_CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")  # as the native build finds it


def run_probe(tmp_path: Path, name: str, compiler: str, flags: list[str], runner: list[str] = ()) -> torch.Tensor:
    binary = tmp_path / name
    subprocess.run([compiler, "-O3", "-std=c11", *flags, f"-I{CSRC}", str(PROBE), "-o", str(binary)], check=True,
                   capture_output=True, timeout=300)
    out = subprocess.run([*runner, str(binary)], check=True, capture_output=True, timeout=600).stdout
    return torch.frombuffer(bytearray(out), dtype=torch.int32)


@pytest.fixture(scope="module")
def software(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """The portable conversion's output (an x86 build without F16C, or any build off x86 and ARM)."""
    if not ON_X86 or HOST_CC is None:
        pytest.skip("the software build is taken on x86 (-march=x86-64 has no F16C), with a C compiler")
    return run_probe(tmp_path_factory.mktemp("probe"), "software", HOST_CC, ["-march=x86-64"])


def test_the_software_conversion_widens_as_torch(software: torch.Tensor) -> None:
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for dtype, offset in ((torch.float16, 0), (torch.bfloat16, 2 * 65536 + 190)):
        expected = patterns.view(dtype).float()
        for start in (offset, offset + 65536):  # load16, then widen16_row
            got = software[start:start + 65536].view(torch.float32)
            finite = expected.isfinite()
            assert torch.equal(got[finite], expected[finite])
            assert torch.equal(got[~finite].isnan(), expected[~finite].isnan())


def test_f16c_gives_the_software_bits(software: torch.Tensor, tmp_path: Path) -> None:
    if "f16c" not in native_build.reported_cpu_features():
        pytest.skip("this CPU has no F16C")
    assert torch.equal(run_probe(tmp_path, "f16c", HOST_CC, ["-march=x86-64-v3"]), software)


def test_arm_gives_the_software_bits(software: torch.Tensor, tmp_path: Path) -> None:
    compiler, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if compiler is None or qemu is None:
        pytest.skip("no aarch64 cross compiler and qemu-user here (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    arm = run_probe(tmp_path, "arm", compiler, ["-march=armv8-a"], [qemu, "-L", "/usr/aarch64-linux-gnu"])
    assert torch.equal(arm, software)


def test_the_kernels_build_for_arm_without_a_warning() -> None:
    """What an ARM CPU compiles (its portable loops and the conversions above): every C library the cpu backend
    builds off x86, with the backend's flags and -Wall."""
    compiler = shutil.which("aarch64-linux-gnu-gcc")
    if compiler is None:
        pytest.skip("no aarch64 cross compiler here (apt-get install gcc-aarch64-linux-gnu)")
    for sources in (library.SOURCES, int8_gemm.SOURCES):
        result = subprocess.run([compiler, *native_build.FLAGS, native_build.OPENMP_FLAG, "-march=armv8-a", "-Wall",
                                 *map(str, sources), "-o", "/dev/null"], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0 and not result.stderr, result.stderr[-4000:]
