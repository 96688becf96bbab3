"""backends/native_build.py: the build machinery: a cache shared between machines, ranks building at once, no
compiler, a compiler that hangs, no OpenMP. A tiny C source stands in for the kernels (seconds less each)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pluginfer.backends.cpu import backend as cpu
from pluginfer.backends.cpu import build as native_build
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

TINY = "#include <omp.h>\nint threads(void) { return omp_get_max_threads(); }\n"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("PLUGINFER_CACHE", str(tmp_path / "cache"))
    native_library.load.cache_clear()
    cpu._report_unavailable.cache_clear()
    yield tmp_path / "cache" / "native"
    native_library.load.cache_clear()
    cpu._report_unavailable.cache_clear()


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, ...]:
    source = tmp_path / "tiny.c"
    source.write_text(TINY)
    return (source,)


def script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def pluginfer_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("pluginfer")]


def test_an_edit_of_an_included_header_rebuilds(cache: Path, tmp_path: Path) -> None:
    """The key covers the headers a source includes with quotes, and theirs; not system headers."""
    (tmp_path / "outer.h").write_text('#pragma once\n#include <stdint.h>\n#include "inner.h"\n')
    (tmp_path / "inner.h").write_text("#pragma once\nstatic inline int seven(void) { return 7; }\n")
    source = tmp_path / "uses.c"
    source.write_text('#include "outer.h"\nint value(void) { return seven(); }\n')
    sources = (source,)
    assert native_build.included_headers(sources) == (tmp_path / "outer.h", tmp_path / "inner.h")
    library, _, first = native_build.build_library("uses", sources)
    assert library.value() == 7

    (tmp_path / "inner.h").write_text("#pragma once\nstatic inline int seven(void) { return 8; }\n")
    library, _, second = native_build.build_library("uses", sources)
    assert second != first and library.value() == 8


def test_the_shipped_libraries_keys_cover_their_shared_header() -> None:
    from pluginfer.backends.cpu import amx_quant

    header = native_library.SOURCES[0].with_name("q8_block_avx512.h")
    assert header in native_build.included_headers(native_library.SOURCES)
    assert header in native_build.included_headers(amx_quant.SOURCES)


def test_a_cache_made_for_other_cpu_features_is_rebuilt(cache: Path, tiny: tuple[Path, ...],
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # One key for both CPUs: as if the key had missed what differs, the check at load must catch it.
    monkeypatch.setattr(native_build, "_cache_key", lambda sources, compiler: "fixed")
    monkeypatch.setattr(native_build, "cpu_features", lambda: frozenset({"sse2", "avx512f"}))
    _, info, path = native_build.build_library("tiny", tiny)
    assert info.features == ["avx512f", "sse2"]
    built = path.stat().st_ino

    monkeypatch.setattr(native_build, "cpu_features", lambda: frozenset({"sse2"}))
    caplog.set_level(logging.INFO)
    _, info, path = native_build.build_library("tiny", tiny)
    assert info.features == ["sse2"] and native_build._read_info(path) == info and path.stat().st_ino != built
    [line] = pluginfer_records(caplog)
    assert "built for a CPU with avx512f, which this one lacks; rebuilding" in line

    caplog.clear()
    native_build.build_library("tiny", tiny)  # now it fits: loaded, nothing said
    assert pluginfer_records(caplog) == []


def test_a_corrupt_cached_library_is_rebuilt_with_one_log_line(cache: Path, tiny: tuple[Path, ...],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    _, info, path = native_build.build_library("tiny", tiny)
    # A new file in its place, not the loaded one truncated: this process still maps the library it
    # opened, and truncating a mapped file ends the process with SIGBUS when the pages are touched (at exit).
    path.unlink()
    path.write_bytes(b"not a shared library")
    caplog.set_level(logging.INFO)
    _, rebuilt, path = native_build.build_library("tiny", tiny)
    assert rebuilt == info and native_build._read_info(path) == info
    [line] = pluginfer_records(caplog)
    assert "is corrupt or not pluginfer's" in line and "rebuilding" in line


def test_two_processes_building_at_once_get_one_library(cache: Path, tiny: tuple[Path, ...],
                                                        tmp_path: Path) -> None:
    calls = tmp_path / "compiles.log"
    # Slow enough that both processes are inside build_library before the first compile ends.
    compiler = script(tmp_path / "cc", f'case "$*" in *build_info.c*) echo "$$" >> {calls}; sleep 2;; esac\n'
                                       f'exec {shutil.which("cc")} "$@"')
    code = ("import sys; from pathlib import Path; from pluginfer.backends.cpu import build as native_build; "
            "library, info, path = native_build.build_library('tiny', (Path(sys.argv[1]),)); "
            "print(path, library.threads())")
    env = dict(os.environ, CC=compiler, PLUGINFER_CACHE=str(cache.parent))
    processes = [subprocess.Popen([sys.executable, "-c", code, str(tiny[0])], env=env, stdout=subprocess.PIPE,
                                  text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=120)[0].split() for process in processes]
    assert all(process.returncode == 0 for process in processes)
    assert outputs[0][0] == outputs[1][0]
    assert len(calls.read_text().split()) == 1, "the library was compiled more than once"
    assert list(cache.glob("*.so")) == [Path(outputs[0][0])]


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "lock-file"])
def test_a_held_build_lock_makes_the_next_builder_wait_then_give_up(tmp_path: Path, flock: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A second holder waits its timeout and is refused, naming the lock; once released the lock is free.
    Without fcntl (lock-file branch) a lock file older than the timeout, left by a builder that died, is taken."""
    if not flock:
        monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` raises ImportError
    lock = tmp_path / "tiny.lock"
    with native_build._file_lock(lock, 5.0):
        with pytest.raises(native_build.NativeKernelsUnavailable, match=f"another process held {lock} for 0.2 s"):
            with native_build._file_lock(lock, 0.2):
                pass
    with native_build._file_lock(lock, 0.2):
        pass
    if not flock:
        assert not lock.exists()
        lock.touch()
        old = time.time() - 60
        os.utime(lock, (old, old))
        with native_build._file_lock(lock, 1.0):
            assert lock.exists()
        assert not lock.exists()


def test_no_compiler_keeps_the_torch_path_with_one_log_line(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "/nonexistent")
    caplog.set_level(logging.INFO)
    assert not cpu.build().native_kernels and not cpu.build().native_kernels
    [line] = pluginfer_records(caplog)
    assert "'/nonexistent' (from CC) not found" in line and "torch path" in line
    assert native.report().startswith("native kernels: not loaded (C compiler '/nonexistent'")


def test_a_compiler_that_hangs_times_out_with_one_log_line(cache: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", script(tmp_path / "cc", "sleep 60"))
    monkeypatch.setenv(native_build.BUILD_TIMEOUT_ENV, "1")
    caplog.set_level(logging.INFO)
    start = time.monotonic()
    assert not cpu.build().native_kernels
    assert time.monotonic() - start < 20
    [line] = pluginfer_records(caplog)
    assert "did not finish in 1 s" in line and "torch path" in line


def test_without_omp_h_the_kernels_build_single_threaded(cache: Path, tiny: tuple[Path, ...], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Apple clang's answer to -fopenmp.
    monkeypatch.setenv("CC", script(tmp_path / "cc", 'case " $* " in *" -fopenmp "*) '
                                    'echo "clang: error: unsupported option \'-fopenmp\'" >&2; exit 1;; esac\n'
                                    f'exec {shutil.which("cc")} "$@"'))
    library, info, _ = native_build.build_library("tiny", tiny)
    assert not info.openmp and "-fopenmp" not in info.flags
    library.threads.restype = ctypes.c_int
    assert library.threads() == 1


def test_the_cpu_features_are_read_once() -> None:
    """Asked for each layer's kernel choice while a model loads: /proc/cpuinfo is read once per process."""
    native_build.reported_cpu_features.cache_clear()
    native_build._features_for.cache_clear()
    first = native_build.cpu_features()
    assert native_build.cpu_features() is first and native_build.reported_cpu_features.cache_info().misses == 1
