"""Building the native libraries: C compiled on first use with the system compiler, cached per machine.

No torch headers are needed, so a build takes seconds. A library is cached under ``$PLUGINFER_CACHE/native``,
keyed by the sources, the compiler, the flags and the CPU's features, and it records the features it was
built for: a cache shared between machines (a home directory on NFS) never hands a library to a CPU that
lacks its instructions; it is rebuilt instead. Ranks on one machine build once (a file lock); a compiler that
hangs is stopped after ``PLUGINFER_NATIVE_BUILD_TIMEOUT`` seconds (120); where ``omp.h`` is missing (Apple
clang) the kernels build single-threaded. The sources ship as package data (docs/architecture.md, "How
native code ships").
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-shared", "-fPIC", "-std=c11"]
ISA_ENV = "PLUGINFER_CPU_ISA"
_BEYOND_AVX512 = ("amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")
_AVX512_AND_LATER = ("avx512", *_BEYOND_AVX512)
_AFTER_ZEN4 = ("avx512_fp16", "avx512_vp2intersect", *_BEYOND_AVX512)
# AMD Zen 4's extensions beyond x86-64-v4, gcc's -m name -> /proc/cpuinfo's flag (-march=znver4 less its tuning,
# spelt so gcc 11 and clang take it)
_ZEN4_EXTENSIONS = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512vbmi": "avx512vbmi",
                    "avx512vbmi2": "avx512_vbmi2", "avx512ifma": "avx512ifma", "avx512bitalg": "avx512_bitalg",
                    "avx512vpopcntdq": "avx512_vpopcntdq", "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq"}
ZEN4_FEATURES = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", *_ZEN4_EXTENSIONS.values()})
# Each ISA choice: (compiler flags, the /proc/cpuinfo flags it hides from the kernels' choices).
ISAS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "native": (["-march=native"], ()),
    "avx2": (["-march=x86-64-v3"], _AVX512_AND_LATER),  # what an AVX2-only CPU builds and runs
    # what a CPU with AVX2 and AVX-VNNI but no AVX-512 builds and runs (Intel's client cores from Alder Lake, the
    # E-core Xeons): the int8 kernels' vpdpbusd on 256 bits
    "avx2-vnni": (["-march=x86-64-v3", "-mavxvnni"], tuple(f for f in _AVX512_AND_LATER if f != "avx_vnni")),
    # what an AMD Zen 4 builds and runs: AVX-512 with VNNI and BF16, no AMX, no AVX512-FP16, no AVX-VNNI
    "zen4": (["-march=x86-64-v4", *(f"-m{name}" for name in _ZEN4_EXTENSIONS)], _AFTER_ZEN4),
}
OPENMP_FLAG = "-fopenmp"
BUILD_TIMEOUT_ENV = "PLUGINFER_NATIVE_BUILD_TIMEOUT"

# Compiled where omp.h is missing (Apple clang): the OpenMP pragmas are ignored and these say one thread.
_OMP_STUB = """#pragma once
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
"""
_OMP_PROBE = "#include <omp.h>\nint pluginfer_omp_probe(void) { return omp_get_max_threads(); }\n"
# Every library carries its BuildInfo as JSON after this marker, read from the file before it is opened.
_INFO_MARKER = "PLUGINFER_BUILD_INFO:"


class NativeKernelsUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here; the reason says why."""


@dataclass(frozen=True)
class BuildInfo:
    """What a cached library was built with; it is compiled into the library itself."""

    compiler: str
    flags: list[str]
    openmp: bool
    machine: str
    # the CPU features its code may use (the whole CPU's for -march=native)
    features: list[str]


def _cache_dir() -> Path:
    root = Path(os.environ.get("PLUGINFER_CACHE", Path.home() / ".cache" / "pluginfer"))
    return root / "native"


def cpu_features() -> frozenset[str]:
    """The instruction-set extensions the kernels may use: what this CPU reports, less what
    ``PLUGINFER_CPU_ISA`` hides."""
    return _features_for(isa())


@functools.cache
def _features_for(isa_name: str) -> frozenset[str]:
    hidden = ISAS[isa_name][1]
    return frozenset(f for f in reported_cpu_features() if not f.startswith(hidden)) if hidden else reported_cpu_features()


# asked ~130 times while a model loads (kernel choices per layer); read once
@functools.cache
def reported_cpu_features() -> frozenset[str]:
    """The instruction-set extensions this CPU reports (Linux ``/proc/cpuinfo``, macOS ``sysctl``); empty
    where neither says."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
        return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    try:
        result = subprocess.run(["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(result.stdout.lower().split()) if result.returncode == 0 else frozenset()


def isa() -> str:
    """``PLUGINFER_CPU_ISA``: ``native`` (default: every extension this CPU has), ``avx2``: the build and kernel
    choices of a CPU without AVX-512, VNNI or AMX, ``avx2-vnni``: those of one with AVX2 and AVX-VNNI but no
    AVX-512 (Intel Alder Lake), or ``zen4``: those of an AMD Zen 4 (AVX-512 with VNNI and BF16, no AMX), so a
    newer machine tests the paths other CPUs take."""
    name = os.environ.get(ISA_ENV, "native")
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV}={name!r} is not one of {', '.join(ISAS)}")
    if name != "native" and platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"{ISA_ENV}={name!r} is for x86-64 CPUs; this one is {platform.machine()}")
    if name in ("avx2", "avx2-vnni") and not {"avx2", "fma", "f16c"} <= reported_cpu_features():
        raise ValueError(f"{ISA_ENV}={name} needs AVX2, FMA and F16C, which this CPU lacks")
    if name == "avx2-vnni" and "avx_vnni" not in reported_cpu_features():
        raise ValueError(f"{ISA_ENV}=avx2-vnni needs AVX-VNNI, which this CPU lacks")
    if name == "zen4" and not ZEN4_FEATURES <= reported_cpu_features():
        missing = ", ".join(sorted(ZEN4_FEATURES - reported_cpu_features()))
        raise ValueError(f"{ISA_ENV}=zen4 needs what an AMD Zen 4 has; this CPU lacks {missing}")
    return name


def _isa_flags_and_features() -> tuple[list[str], list[str]]:
    return ISAS[isa()][0], sorted(cpu_features())


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeKernelsUnavailable("no C compiler (cc/gcc) on PATH")
    path = shutil.which(compiler)
    if path is None:
        raise NativeKernelsUnavailable(f"C compiler {compiler!r} (from CC) not found")
    return path


def _build_timeout() -> float:
    text = os.environ.get(BUILD_TIMEOUT_ENV, "120")
    try:
        return float(text)
    except ValueError:
        raise NativeKernelsUnavailable(f"{BUILD_TIMEOUT_ENV}={text!r} is not a number of seconds") from None


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def included_headers(sources: tuple[Path, ...]) -> tuple[Path, ...]:
    """The headers ``sources`` include with ``#include "..."`` (beside the including file), and the ones
    those include, each once, in the order first met; system headers (``<...>``) are not followed."""
    found: list[Path] = []
    pending = list(sources)
    while pending:
        path = pending.pop(0)
        for name in _LOCAL_INCLUDE.findall(path.read_bytes()):
            header = path.parent / name.decode()
            if header.is_file() and header not in found and header not in sources:
                found.append(header)
                pending.append(header)
    return tuple(found)


def _cache_key(sources: tuple[Path, ...], compiler: str) -> str:
    """Sources and the headers they include, flags, the compiler's identity (its file), the architecture
    and the CPU's features."""
    stat = os.stat(compiler)
    features = " ".join(sorted(cpu_features())) or platform.processor()
    files = (*sources, *included_headers(sources))
    isa_flags = _isa_flags_and_features()[0]
    parts = [b"".join(path.read_bytes() for path in files), " ".join([*isa_flags, *FLAGS, OPENMP_FLAG]).encode(),
             f"{os.path.realpath(compiler)} {stat.st_size} {stat.st_mtime_ns}".encode(),
             platform.machine().encode(), features.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a compiler; past ``timeout`` it and its children are killed and the kernels are unavailable."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # its own group: cc1, as and ld die with it
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (AttributeError, OSError):  # no process groups here
            process.kill()
        process.wait()
        raise NativeKernelsUnavailable(f"C compiler {command[0]!r} did not finish in {timeout:g} s "
                                       f"({BUILD_TIMEOUT_ENV} sets the limit)") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _wait_for(acquire: Callable[[], bool], path: Path, timeout: float) -> None:
    """Try ``acquire`` every 50 ms until it succeeds; past ``timeout`` seconds the kernels are unavailable."""
    deadline = time.monotonic() + timeout
    while not acquire():
        if time.monotonic() > deadline:
            raise NativeKernelsUnavailable(f"another process held {path} for {timeout:g} s")
        time.sleep(0.05)


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    """Exclusive between processes: ``flock``, or where fcntl is missing a lock file created exclusively."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if fcntl is not None:
        with open(path, "a") as handle:
            def flock() -> bool:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                return True

            _wait_for(flock, path, timeout)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return

    def create() -> bool:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > timeout:  # left by a builder that died
                    path.unlink()
            return False
        return True

    _wait_for(create, path, timeout)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _compile(compiler: str, sources: tuple[Path, ...], target: Path) -> None:
    """Compile into ``target`` (atomically: concurrent readers never see half a file), OpenMP if it exists."""
    timeout = _build_timeout()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as work_dir:
        work = Path(work_dir)
        (work / "probe.c").write_text(_OMP_PROBE)
        probe = _run([compiler, OPENMP_FLAG, "-shared", "-fPIC", str(work / "probe.c"), "-o", str(work / "probe.so")],
                     timeout)
        openmp = probe.returncode == 0
        isa_flags, features = _isa_flags_and_features()
        flags = [*isa_flags, *FLAGS, OPENMP_FLAG] if openmp else [*isa_flags, *FLAGS]
        if not openmp:
            logger.info("native kernels: no OpenMP with %s (%s); building them single-threaded", compiler,
                        probe.stderr.strip().splitlines()[-1:] or "no message")
            (work / "omp.h").write_text(_OMP_STUB)
        info = BuildInfo(compiler, flags, openmp, platform.machine(), features)
        literal = json.dumps(_INFO_MARKER + json.dumps(asdict(info)))
        (work / "build_info.c").write_text(f"const char pluginfer_build_info[] = {literal};\n")
        staging = work / target.name
        include = [] if openmp else ["-I", str(work)]
        result = _run([compiler, *flags, *include, *map(str, sources), str(work / "build_info.c"),
                       "-o", str(staging), "-lm"], timeout)
        if result.returncode != 0:
            raise NativeKernelsUnavailable(f"compiling {', '.join(s.name for s in sources)} failed: "
                                           f"{result.stderr.strip()[:500]}")
        staging.replace(target)


def _stamp(path: Path) -> tuple[int, int] | None:
    """Which file is at ``path`` now (a rebuild replaces it with a new one), or None."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _read_info(path: Path) -> BuildInfo:
    data = path.read_bytes()
    start = data.index(_INFO_MARKER.encode()) + len(_INFO_MARKER)
    return BuildInfo(**json.loads(data[start:data.index(b"\0", start)]))


def _open(target: Path) -> tuple[ctypes.CDLL, BuildInfo] | None:
    """The cached library and its build, or None (with one log line) when it must be rebuilt: corrupt,
    foreign, or built for CPU features this one lacks (checked before it is opened: glibc keeps a
    library opened once for the rest of the process, whatever replaces the file)."""
    try:
        info = _read_info(target)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("native kernels: cached %s is corrupt or not pluginfer's (%s: %s); rebuilding", target,
                       type(exc).__name__, str(exc)[:200])
        return None
    missing = set(info.features) - cpu_features()
    if info.machine != platform.machine() or missing:
        lacks = ", ".join(sorted(missing)[:8]) + (" ..." if len(missing) > 8 else "") or info.machine
        logger.warning("native kernels: cached %s was built for a CPU with %s, which this one lacks; rebuilding",
                       target, lacks)
        return None
    try:
        return ctypes.CDLL(str(target)), info
    except OSError as exc:
        logger.warning("native kernels: cached %s does not load (%s); rebuilding", target, str(exc)[:200])
        return None


def build_library(name: str, sources: tuple[Path, ...]) -> tuple[ctypes.CDLL, BuildInfo, Path]:
    """The library of ``sources`` for this machine, from the cache or compiled now: once per machine
    (processes that arrive meanwhile wait on a file lock and open the same file)."""
    compiler = _compiler()
    cache = _cache_dir()
    target = cache / f"{name}-{_cache_key(sources, compiler)}.so"
    before = _stamp(target)
    opened = _open(target) if before is not None else None
    if opened is None:
        cache.mkdir(parents=True, exist_ok=True)
        with _file_lock(target.with_suffix(".lock"), 2 * _build_timeout() + 60):
            if _stamp(target) not in (None, before):
                opened = _open(target)  # another process built it while this one waited
            if opened is None:
                _compile(compiler, sources, target)
                opened = _open(target)
        if opened is None:
            raise NativeKernelsUnavailable(f"the library just built, {target}, does not load")
    return (*opened, target)
