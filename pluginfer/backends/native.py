"""Native CPU kernels: C compiled on first use with the system compiler, loaded through ctypes.

No torch headers are needed, so the build takes seconds. The library is cached under
``$PLUGINFER_CACHE/native``, keyed by the sources, the compiler, the flags and the CPU's features, and
it records the features it was built for: a cache shared between machines (a home directory on NFS)
never hands a library to a CPU that lacks its instructions; it is rebuilt instead. Ranks on one
machine build once (a file lock); a compiler that hangs is stopped after ``PLUGINFER_NATIVE_BUILD_TIMEOUT``
seconds (120); where ``omp.h`` is missing (Apple clang) the kernels build single-threaded. When no
library can be had (or ``PLUGINFER_NATIVE=0``) the cpu backend keeps its torch path and logs once why,
and how to get them. The sources ship as package data (docs/architecture.md, "How native code ships").
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("cpu_kernels.c", "panel_linear.c", "quant_dot.c", "half_linear.c", "step_replay.c"))
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]
OPENMP_FLAG = "-fopenmp"
BUILD_TIMEOUT_ENV = "PLUGINFER_NATIVE_BUILD_TIMEOUT"
# What a log line about missing kernels tells the user to do.
HOW_TO_GET = "install a C compiler (gcc or clang; CC picks one) and restart; PLUGINFER_NATIVE=0 silences this"

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
    features: list[str]  # the CPU features present when it was built with -march=native


def _cache_dir() -> Path:
    root = Path(os.environ.get("PLUGINFER_CACHE", Path.home() / ".cache" / "pluginfer"))
    return root / "native"


def cpu_features() -> frozenset[str]:
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


def _cache_key(sources: tuple[Path, ...], compiler: str) -> str:
    """Sources, flags, the compiler's identity (its file), the architecture and the CPU's features."""
    stat = os.stat(compiler)
    features = " ".join(sorted(cpu_features())) or platform.processor()
    parts = [b"".join(path.read_bytes() for path in sources), " ".join([*FLAGS, OPENMP_FLAG]).encode(),
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


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    """Exclusive between processes: ``flock``, or where fcntl is missing a lock file created exclusively."""
    deadline = time.monotonic() + timeout
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if fcntl is not None:
        with open(path, "a") as handle:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise NativeKernelsUnavailable(f"another process held {path} for {timeout:g} s") from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return
    while True:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > timeout:  # left by a builder that died
                    path.unlink()
            if time.monotonic() > deadline:
                raise NativeKernelsUnavailable(f"another process held {path} for {timeout:g} s") from None
            time.sleep(0.05)
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
        flags = [*FLAGS, OPENMP_FLAG] if openmp else list(FLAGS)
        if not openmp:
            logger.info("native kernels: no OpenMP with %s (%s); building them single-threaded", compiler,
                        probe.stderr.strip().splitlines()[-1:] or "no message")
            (work / "omp.h").write_text(_OMP_STUB)
        info = BuildInfo(compiler, flags, openmp, platform.machine(), sorted(cpu_features()))
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


_pointer, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Every C function native.py calls: (restype, argtypes); a recording packs arguments by these.
SIGNATURES = {
    "paged_decode_attention": (ctypes.c_int, [_pointer] * 6 + [_i64] * 7 + [_f32, _i64, _f32]),
    "rms_norm": (None, [_pointer] * 4 + [_i64, _i64, _f32, _f32]),
    "silu_and_mul": (None, [_pointer, _pointer, _i64, _i64]),
    "rotary_neox": (None, [_pointer] * 4 + [_i64] * 7),
    "ggml_dequantize_rows": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _i64, _pointer]),
    "ggml_dequantize_rows_bf16": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _i64, _pointer]),
    "grouped_dequantize": (ctypes.c_int, [ctypes.c_int, _pointer, _pointer, _pointer, ctypes.c_int, _pointer]
                           + [_i64] * 6 + [_pointer, ctypes.c_int]),
    "int4_dequantize_rows": (ctypes.c_int, [_pointer] * 3 + [_i64] * 3 + [_pointer, ctypes.c_int]),
    "panel_linear_supported": (ctypes.c_int, []),
    "panel_padded_outputs": (_i64, [_i64]),
    "pack_panels": (None, [_pointer, _pointer, _i64, _i64]),
    "panel_linear": (ctypes.c_int, [_pointer] * 4 + [_i64] * 3),
    "quant_dot_supported": (ctypes.c_int, []),
    "quant_dot_max_threads": (ctypes.c_int, []),
    "quant_matmul": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _i64, _pointer]),
    "quant_dot_quantize": (ctypes.c_int, [_pointer, _i64, _i64, _pointer, _pointer]),
    "half_linear_supported": (ctypes.c_int, []),
    "half_linear": (ctypes.c_int, [ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _pointer, _pointer, ctypes.c_int]),
    "gather_rows": (ctypes.c_int, [_pointer, _i64, _i64, _pointer, _i64, _i64, _pointer]),
    "scatter_rows": (ctypes.c_int, [_pointer, _i64, _pointer, _pointer, _i64, _i64, _i64]),
    "add_f32": (None, [_pointer] * 3 + [_i64] * 3),
    "to_f32": (None, [_pointer, ctypes.c_int, _pointer, _i64]),
    "copy_rows": (None, [_pointer, _i64, _i64, _i64, _pointer, _i64]),
    "add_bf16": (None, [_pointer] * 3 + [_i64] * 3),
    "step_replay": (_i64, [_pointer, _i64, _pointer]),
    # 16-bit activations (the last argument: HALF_CODES)
    "paged_decode_attention_16": (ctypes.c_int, [_pointer] * 6 + [_i64] * 7 + [_f32, _i64, _f32, ctypes.c_int]),
    "rms_norm_16": (None, [_pointer] * 4 + [_i64, _i64, _f32, _f32, ctypes.c_int]),
    "silu_and_mul_16": (None, [_pointer, _pointer, _i64, _i64, ctypes.c_int]),
    "rotary_neox_16": (None, [_pointer] * 4 + [_i64] * 7 + [ctypes.c_int]),
}
# The 16-bit dtypes the norm, activation, rotary and decode attention kernels also take (csrc/cpu_kernels.c).
HALF_CODES = {torch.float16: 1, torch.bfloat16: 2}
# Entries of step_replay that are no function of this library: quant_matmul's arguments behind the address of
# another library's kernel of that signature (amx_quant.c's tiles).
REPLAY_SIGNATURES = {
    "quant_matmul_at": (ctypes.c_int, [_pointer, ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _i64, _pointer]),
}


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The compiled kernel library (built once per source version, compiler and machine)."""
    if os.environ.get("PLUGINFER_NATIVE", "1") == "0":
        raise NativeKernelsUnavailable("disabled by PLUGINFER_NATIVE=0")
    library, info, path = build_library("cpu_kernels", SOURCES)
    _loaded.update(info=info, path=path)
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


_loaded: dict = {}  # the BuildInfo and path of the library load() returned last


def report() -> str:
    """One line for `pluginfer plugins`: which kernels loaded, for which instruction set, or why not."""
    reason = available()
    if reason is not None:
        return f"native kernels: not loaded ({reason}); torch path"
    library, info = load(), _loaded["info"]
    isa = "AVX-512" if library.panel_linear_supported() else info.machine
    fused_isa = QUANT_DOT_ISAS.get(library.quant_dot_supported())
    fused = f"int8 GGML matmul ({fused_isa})" if fused_isa else "no fused int8 GGML matmul"
    half_isa = HALF_LINEAR_ISAS.get(library.half_linear_supported())
    fused += f"; 16-bit GEMV ({half_isa})" if half_isa else "; no 16-bit GEMV"
    threads = "OpenMP" if info.openmp else "single-threaded (no OpenMP)"
    return (f"native kernels: loaded for {info.machine} {isa} (attention, norms, rotary, dequantization"
            f"{', panel GEMM' if isa == 'AVX-512' else ''}; {fused}), {threads}, from {_loaded['path']}")


def available() -> str | None:
    """None when the kernels load, else the reason they do not."""
    try:
        load()
    except (NativeKernelsUnavailable, OSError) as exc:
        return str(exc)
    return None


# Kernels a recorded step may call, by their code in csrc/step_replay.c (its enum, in this order).
REPLAY_OPS = ("paged_decode_attention", "rms_norm", "silu_and_mul", "rotary_neox", "ggml_dequantize_rows",
              "panel_linear", "quant_matmul", "half_linear", "gather_rows", "scatter_rows", "add_f32", "to_f32",
              "copy_rows", "quant_matmul_at", "paged_decode_attention_16", "rms_norm_16", "silu_and_mul_16",
              "rotary_neox_16", "add_bf16")
_REPLAY_CODES = {name: code for code, name in enumerate(REPLAY_OPS, start=1)}


class StepRecording:
    """The native calls of one eager step, as a program ``step_replay`` runs again in one C call.

    While it is active (:func:`recording`, in this thread) the wrappers of this module reach the library
    through it: each call runs as usual and is appended to :attr:`program` with its arguments (pointers
    as addresses: the caller keeps the tensors alive); a call of a kernel ``step_replay`` cannot run
    refuses the recording, and :attr:`refused` says which. :meth:`append` also takes the copy-like ops
    of ``csrc/step_replay.c`` that stand in for torch ops (``cpu_step_replay``)."""

    def __init__(self) -> None:
        self.program: list[int] = []
        self.names: list[str] = []
        self.refused: str | None = None

    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def append(self, name: str, *args: object) -> None:
        code = _REPLAY_CODES.get(name)
        if code is None:
            self.refuse(f"native {name} has no replay entry")
            return
        packed = [struct.unpack("<q", struct.pack("<d", value))[0] if kind is _f32 else int(value or 0)
                  for value, kind in zip(args, (SIGNATURES.get(name) or REPLAY_SIGNATURES[name])[1], strict=True)]
        self.program += [code, len(packed), *packed]
        self.names.append(name)

    def __getattr__(self, name: str) -> Callable:
        function = getattr(load(), name)

        def call(*args: object) -> object:
            result = function(*args)
            self.append(name, *args)
            return result

        return call


_state = threading.local()  # .recording: the StepRecording of this thread, if one is active


def _lib() -> ctypes.CDLL | StepRecording:
    """The library, or this thread's active recording in front of it."""
    recorder = getattr(_state, "recording", None)
    return load() if recorder is None else recorder


@contextlib.contextmanager
def recording() -> Iterator[StepRecording]:
    """Record the native calls made in this thread inside the block (see :class:`StepRecording`)."""
    if getattr(_state, "recording", None) is not None:
        raise RuntimeError("native calls are already being recorded in this thread")
    _state.recording = StepRecording()
    try:
        yield _state.recording
    finally:
        _state.recording = None


class StepProgram:
    """A finished recording, replayed by one call of ``step_replay`` (no Python between its kernels)."""

    def __init__(self, recorded: StepRecording) -> None:
        if recorded.refused is not None:
            raise ValueError(f"a refused recording cannot be replayed: {recorded.refused}")
        self.program = torch.tensor(recorded.program, dtype=torch.int64)
        self.names = list(recorded.names)
        self._status = ctypes.c_int64(0)

    def __len__(self) -> int:
        return len(self.names)

    def run(self) -> None:
        failed = load().step_replay(self.program.data_ptr(), self.program.numel(), ctypes.addressof(self._status))
        if failed:
            raise RuntimeError(f"step replay: entry {failed - 1} ({self.names[failed - 1]}) failed with status "
                               f"{self._status.value}")


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """Decode attention over the paged cache; query ``[seqs, heads, dim]``. float32 caches, or float16/bfloat16
    ones (the query and the result then in the caches' dtype, the arithmetic in float32)."""
    half = HALF_CODES.get(key_cache.dtype)
    if half is not None:
        return _paged_decode_attention_16(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                          sliding_window, soft_cap, half)
    query, block_tables, seq_lens = _as(query, torch.float32), _as(block_tables, torch.int64), _as(seq_lens, torch.int64)
    if not (_fits(key_cache) and _fits(value_cache)):
        raise ValueError("paged_decode_attention needs contiguous float32 key and value caches")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, v_dim = value_cache.shape
    out = torch.empty(num_seqs, num_heads, v_dim, dtype=torch.float32)
    status = _lib().paged_decode_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, v_dim, block_size,
        block_tables.shape[1], scale, sliding_window or 0, soft_cap or 0.0,
    )
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its score buffer")
    return out


def _paged_decode_attention_16(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None, soft_cap: float | None, half: int) -> torch.Tensor:
    dtype = key_cache.dtype
    query, block_tables, seq_lens = _as(query, dtype), _as(block_tables, torch.int64), _as(seq_lens, torch.int64)
    if value_cache.dtype != dtype or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"paged_decode_attention needs contiguous key and value caches of one dtype, got "
                         f"{key_cache.dtype} and {value_cache.dtype}")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, v_dim = value_cache.shape
    out = torch.empty(num_seqs, num_heads, v_dim, dtype=dtype)
    status = _lib().paged_decode_attention_16(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, v_dim, block_size,
        block_tables.shape[1], scale, sliding_window or 0, soft_cap or 0.0, half,
    )
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its score buffer")
    return out


def _fits_half(dtype: torch.dtype, *tensors: torch.Tensor) -> int | None:
    """The kernel's code for 16-bit ``dtype`` when every tensor has it and is contiguous, else None."""
    half = HALF_CODES.get(dtype)
    for tensor in tensors:
        if tensor.dtype != dtype or not tensor.is_contiguous():
            return None
    return half


def _fits(*tensors: torch.Tensor) -> bool:
    """Every tensor float32 and contiguous (a plain loop: these checks run several times per layer and step)."""
    for tensor in tensors:
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            return False
    return True


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype`` and contiguous, the tensor itself when it is already (no call otherwise)."""
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             offset: float) -> torch.Tensor | None:
    """Fused (residual add +) RMSNorm; updates ``residual`` in place. None: use the torch path."""
    if x.dtype != torch.float32:  # float16/bfloat16: rounded where layers/norm.py's reference rounds
        half = _fits_half(x.dtype, x, weight) if residual is None else _fits_half(x.dtype, x, weight, residual)
        if half is None:
            return None
        out = torch.empty_like(x)
        _lib().rms_norm_16(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                           out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, offset, half)
        return out
    if not (_fits(x) and _fits(weight)) or (residual is not None and not _fits(residual)):
        return None
    out = torch.empty_like(x)
    _lib().rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                    out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, offset)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(x[:, :n]) * x[:, n:]``. None: use the torch path."""
    if x.dtype != torch.float32:  # float16/bfloat16: rounded where F.silu(gate) * up rounds
        half = _fits_half(x.dtype, x)
        if half is None:
            return None
        n = x.shape[-1] // 2
        out = x.new_empty(*x.shape[:-1], n)
        _lib().silu_and_mul_16(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], n, half)
        return out
    if not _fits(x):
        return None
    n = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], n)
    _lib().silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], n)
    return out


def rotary_neox(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary_dim: int) -> bool:
    """Rotate q ``[tokens, heads, dim]`` and k in place (rows may be strided), float32 or float16/bfloat16 (in
    float32 with the float32 cos/sin, rounded once). False: use the torch path."""
    half = HALF_CODES.get(query.dtype)
    if half is not None and key.dtype == query.dtype and _fits(cos) and _fits(sin) \
            and query.stride()[1:] == (query.shape[2], 1) and key.stride()[1:] == (key.shape[2], 1):
        _lib().rotary_neox_16(query.data_ptr(), key.data_ptr(), cos.data_ptr(), sin.data_ptr(), query.shape[0],
                              query.shape[1], key.shape[1], query.shape[2], rotary_dim, query.stride(0),
                              key.stride(0), half)
        return True
    if not (query.dtype == key.dtype == torch.float32 and _fits(cos) and _fits(sin)
            and query.stride()[1:] == (query.shape[2], 1) and key.stride()[1:] == (key.shape[2], 1)):
        return False
    _lib().rotary_neox(query.data_ptr(), key.data_ptr(), cos.data_ptr(), sin.data_ptr(), query.shape[0],
                       query.shape[1], key.shape[1], query.shape[2], rotary_dim, query.stride(0), key.stride(0))
    return True


# The dtypes the dequantization kernels write: float32, or bfloat16 rounded to nearest even from it.
TILE_DTYPES = (torch.float32, torch.bfloat16)


def _output(out: torch.Tensor | None, rows: int, cols: int, op: str, dtype: torch.dtype | None) -> torch.Tensor:
    """A float32 or bfloat16 ``[rows, cols]`` result: new (``dtype``, float32 by default), or a view of the
    front of a caller's reusable buffer, whose dtype is the result's (``dtype``, if given, must agree)."""
    if out is None:
        dtype = torch.float32 if dtype is None else dtype
        if dtype not in TILE_DTYPES:
            raise ValueError(f"{op} writes float32 or bfloat16, not {dtype}")
        return torch.empty(rows, cols, dtype=dtype)
    if (out.dtype not in TILE_DTYPES or dtype not in (None, out.dtype) or not out.is_contiguous()
            or out.numel() < rows * cols):
        raise ValueError(f"{op} needs a contiguous {'float32 or bfloat16' if dtype is None else dtype} out of "
                         f"{rows * cols} elements, got {out.dtype} {tuple(out.shape)}")
    return out.view(-1)[:rows * cols].view(rows, cols)


# gguf.GGMLQuantizationType values ggml_dequantize_rows handles (Q4_0 ... Q8_0, Q2_K ... Q6_K).
GGML_DEQUANTIZABLE = frozenset({2, 3, 6, 7, 8, 10, 11, 12, 13, 14})


def ggml_dequantize(raw: torch.Tensor, qtype: int, cols: int, out: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Raw GGML blocks uint8 ``[rows, row_bytes]`` to float32 ``[rows, cols]`` (into ``out`` when
    given, a contiguous tensor of at least ``rows * cols`` elements), bit-exact with
    ``ggml_blocks.dequantize``. bfloat16 (``dtype``, or ``out``'s dtype): in one pass, each value that
    float32 value rounded to nearest even, equal to ``ggml_blocks.dequantize(...).to(torch.bfloat16)``
    bit for bit. None: a type (or a non-contiguous ``raw``) this kernel does not handle; use the torch path."""
    qtype = int(qtype)
    rows = raw.shape[0]
    if qtype not in GGML_DEQUANTIZABLE or raw.dtype != torch.uint8 or not raw.is_contiguous():
        return None
    out = _output(out, rows, cols, "ggml_dequantize", dtype)
    kernel = _lib().ggml_dequantize_rows if out.dtype == torch.float32 else _lib().ggml_dequantize_rows_bf16
    status = kernel(qtype, raw.data_ptr(), rows, raw.shape[1], cols, out.data_ptr())
    if status != 0:  # the columns are not whole blocks filling each row
        raise ValueError(f"ggml_dequantize: {cols} columns of GGML type {qtype} do not fit rows of "
                         f"{raw.shape[1]} bytes")
    return out


# Scale dtypes grouped_dequantize reads, by the code its C kernel takes.
SCALE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def grouped_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                       bits: int, start: int, stop: int, out: torch.Tensor | None = None,
                       dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Output columns ``start:stop`` of the GPTQ/AWQ layout (``pluginfer.quant.packing``) as float32
    ``[in, stop - start]`` (into ``out`` when given, a contiguous tensor of at least that many
    elements), bit-exact with ``GroupQuantLinear.dequantize_columns`` in float32 (which returns its
    transpose); bfloat16 (``dtype`` or ``out``'s): those values rounded to nearest even, in one pass.
    ``g_idx`` must name groups of ``scales``, as loading checks. None: bits, dtypes,
    devices or strides this kernel does not handle; use the torch path."""
    if bits not in (4, 8):
        return None
    pack = 32 // bits
    in_features, rows, groups = qweight.shape[0] * pack, stop - start, scales.shape[0]
    tensors = (qweight, qzeros, scales) if g_idx is None else (qweight, qzeros, scales, g_idx)
    if (scales.dtype not in SCALE_TYPES or qweight.dtype != torch.int32 or qzeros.dtype != torch.int32
            or (g_idx is not None and (g_idx.dtype != torch.int32 or g_idx.numel() != in_features))
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or groups == 0 or in_features % groups or scales.shape[1] != qweight.shape[1]
            or qzeros.shape[0] != groups or start % pack or stop % pack
            or not 0 <= start < stop <= qweight.shape[1] or qzeros.shape[1] * pack < stop):
        return None
    out = _output(out, in_features, rows, "grouped_dequantize", dtype)
    status = _lib().grouped_dequantize(
        bits, qweight.data_ptr(), qzeros.data_ptr(), scales.data_ptr(), SCALE_TYPES[scales.dtype],
        g_idx.data_ptr() if g_idx is not None else None, in_features, qweight.shape[1], groups, qzeros.shape[1],
        start, stop, out.data_ptr(), int(out.dtype == torch.bfloat16))
    if status == -3:
        raise MemoryError("grouped_dequantize could not allocate its per-group buffers")
    if status != 0:
        raise ValueError(f"grouped_dequantize: status {status} for bits {bits}, columns {start}:{stop}")
    return out


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Rows of the int4 method's layout (``pluginfer.quant.int4``) as float32 ``[rows, in]`` (into ``out``
    when given, a contiguous tensor of at least that many elements), bit-exact with
    ``int4.dequantize_int4``; bfloat16 (``dtype`` or ``out``'s): those values rounded to nearest even, in
    one pass. None: dtypes, devices, strides or shapes this kernel does not handle."""
    rows, in_features = qweight.shape[0], qweight.shape[1] * 2
    tensors = (qweight, scales, zeros)
    if (qweight.dtype != torch.uint8 or scales.dtype != torch.float16 or zeros.dtype != torch.float16
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or scales.shape != zeros.shape or scales.shape[0] != rows or scales.shape[1] == 0
            or in_features % scales.shape[1] or (in_features // scales.shape[1]) % 2):
        return None
    out = _output(out, rows, in_features, "int4_dequantize", dtype)
    _lib().int4_dequantize_rows(qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), rows, in_features,
                                in_features // scales.shape[1], out.data_ptr(), int(out.dtype == torch.bfloat16))
    return out


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` float32 CPU weight -> panels of 16 outputs (``[padded out / 16, in, 16]``, zero
    rows padding ``out`` to a multiple of 64; ``csrc/panel_linear.c``)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_panels needs a 2-d float32 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    out_features, in_features = weight.shape
    weight = weight.contiguous()
    packed = torch.empty(load().panel_padded_outputs(out_features) // 16, in_features, 16, dtype=torch.float32)
    _lib().pack_panels(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
    return packed


def panel_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` over any leading dims of float32 ``x``, W packed by :func:`pack_panels`."""
    in_features = packed.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != in_features:
        raise ValueError(f"panel_linear needs float32 inputs of {in_features} features, got {x.dtype} "
                         f"{tuple(x.shape)}")
    rows = x.numel() // in_features
    flat = x.reshape(rows, in_features).contiguous()
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    if rows and _lib().panel_linear(flat.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                                    out.data_ptr(), rows, out_features, in_features):
        raise MemoryError("panel_linear could not allocate its row buffer")
    return out


# gguf.GGMLQuantizationType values quant_matmul handles (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
QUANT_MATMUL_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
QUANT_ACTIVATIONS_ENV = "PLUGINFER_QUANT_ACTIVATIONS"


def ggml_quant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, cols: int) -> torch.Tensor | None:
    """``x @ W^T`` for float ``x [..., cols]`` and ``W`` the raw GGML blocks uint8 ``[rows, row_bytes]``,
    without a float copy of ``W`` (``csrc/quant_dot.c``): each row of ``x`` is quantized per block of
    32 to int8 with a float32 scale, as llama.cpp's Q8_0, and multiplied with the weights' levels in
    integers; from a few rows up, on a CPU with AMX, on int8 tiles (``backends/amx_quant.py``).
    The result has ``x``'s dtype (float16/bfloat16 ``x`` is converted to float32 and back).
    None: a type, dtype, device or layout it does not handle; use the dequantizing path."""
    qtype = int(qtype)
    # (is_cpu, not device.type: this runs for every linear of every decode step, where each check shows)
    if (qtype not in QUANT_MATMUL_TYPES or raw.dtype != torch.uint8 or raw.dim() != 2 or not raw.is_contiguous()
            or not raw.is_cpu or not x.is_cpu or not x.dtype.is_floating_point or x.shape[-1] != cols):
        return None
    if x.dim() == 2:  # the engine's flat [tokens, features]
        rows = x.shape[0]
        flat = _as(x, torch.float32)
        out = torch.empty((rows, raw.shape[0]), dtype=torch.float32)
    else:
        rows = x.numel() // cols if cols else 0
        flat = _as(x.reshape(rows, cols), torch.float32)
        out = torch.empty(*x.shape[:-1], raw.shape[0], dtype=torch.float32)
    if rows >= 2:  # AMX int8 tiles from amx_quant.MIN_ROWS rows, where the CPU has them
        from pluginfer.backends import amx_quant
        if amx_quant.takes(qtype, rows):
            amx_quant.call(qtype, flat, rows, cols, raw, out)
            recorder = getattr(_state, "recording", None)
            if recorder is not None:  # the tiles' kernel lives in its own library: replayed through its address
                _record_at(recorder, amx_quant.library().amx_quant_matmul, qtype, flat.data_ptr(), rows, cols,
                           raw.data_ptr(), raw.shape[0], raw.shape[1], out.data_ptr())
            return out if x.dtype == torch.float32 else out.to(x.dtype)
    status = _lib().quant_matmul(qtype, flat.data_ptr(), rows, cols, raw.data_ptr(), raw.shape[0], raw.shape[1],
                                 out.data_ptr())
    if status == -3:
        raise MemoryError("quant_matmul could not allocate its activation buffer")
    if status != 0:  # -2: the columns are not whole blocks filling each row; -4: no kernel on this CPU
        raise ValueError(f"quant_matmul: status {status} for GGML type {qtype}, {cols} columns, rows of "
                         f"{raw.shape[1]} bytes")
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _record_at(recorder: StepRecording, kernel: object, *args: object) -> None:
    """Note a call of another library's ctypes function of quant_matmul's signature (its address, then
    its arguments); anything else in its place (not a C function) refuses the recording."""
    try:
        address = ctypes.cast(kernel, _pointer).value
    except (ctypes.ArgumentError, TypeError):
        recorder.refuse(f"{kernel!r} is not a C function a replay can call")
        return
    recorder.append("quant_matmul_at", address, *args)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization of :func:`ggml_quant_matmul` alone (for tests): float32 ``[rows, cols]``
    to int8 levels ``[rows, cols]`` and float32 scales ``[rows, cols / 32]``."""
    x = x.to(torch.float32).contiguous()
    rows, cols = x.shape
    levels = torch.empty(rows, cols, dtype=torch.int8)
    scales = torch.empty(rows, cols // 32, dtype=torch.float32)
    status = _lib().quant_dot_quantize(x.data_ptr(), rows, cols, levels.data_ptr(), scales.data_ptr())
    if status != 0:
        raise ValueError(f"quantize_activations: status {status} for shape {tuple(x.shape)}")
    return levels, scales


class TileDequantize:
    """A tile dequantization op (``grouped_dequantize``, ``int4_dequantize``) carrying the cpu backend's
    choice of ``tile_dtype``: the dtype a quantized linear's tiles are dequantized to and multiplied in
    (``quant.tiled.tiled_linear``; float32 inputs are rounded to it once per call, outputs are float32)."""

    def __init__(self, dequantize: Callable, tile_dtype: torch.dtype) -> None:
        self.dequantize, self.tile_dtype = dequantize, tile_dtype
        # float32 x of fewer rows keeps float32 tiles (bfloat16 ones would round it for no gain in speed)
        self.tile_dtype_min_rows = TILE_DTYPE_MIN_ROWS.get(tile_dtype, 0)

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor | None:
        return self.dequantize(*args, **kwargs)


class GGMLDequantize(TileDequantize):
    """The ``ggml_dequantize`` op where the fused matmul runs too, or where tiles are bfloat16: calls
    :func:`ggml_dequantize`, and ``quant_matmul`` is the fused int8-activation matmul for the same blocks
    (``op("ggml_quant_matmul")``, or None), which ``ggml_blocks.ggml_linear`` takes up to
    ``quant_matmul_max_rows`` rows of ``x``, and tiles in ``tile_dtype`` above. Where the fused kernel is off
    (no AVX2, ``PLUGINFER_QUANT_ACTIVATIONS=float``) and the tiles are float32 the op is plain
    :func:`ggml_dequantize`."""

    def __init__(self, dequantize: Callable, quant_matmul: Callable | None,
                 tile_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(dequantize, tile_dtype)
        self.quant_matmul = quant_matmul
        # GGML type -> rows of x up to which ggml_linear takes quant_matmul
        self.quant_matmul_max_rows = quant_matmul_max_rows(tile_dtype) if quant_matmul is not None else {}

    def __call__(self, raw: torch.Tensor, qtype: int, cols: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.dequantize(raw, qtype, cols, out)


_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


# What quant_dot_supported() returns in C: the instruction set the fused matmul was built for.
QUANT_DOT_ISAS = {1: "AVX-512 VNNI", 2: "AVX2 + AVX-VNNI", 3: "AVX2"}


def quant_dot_isa() -> str | None:
    """The instruction set the fused quantized matmul runs with here (``csrc/quant_dot.c``), or None
    where the library was built for a CPU without AVX2."""
    return QUANT_DOT_ISAS.get(load().quant_dot_supported())


def quant_dot_supported() -> bool:
    """Whether this CPU runs the fused quantized matmul (AVX-512 VNNI, or AVX2)."""
    return quant_dot_isa() is not None


def quant_matmul_op() -> Callable | None:
    """:func:`ggml_quant_matmul` where this CPU runs it and ``PLUGINFER_QUANT_ACTIVATIONS`` is not
    ``float``; else None. Says which, once per process."""
    mode = os.environ.get(QUANT_ACTIVATIONS_ENV, "int8").lower()
    if mode not in ("int8", "float"):
        raise ValueError(f"{QUANT_ACTIVATIONS_ENV}={mode!r}: expected 'int8' (the default) or 'float'")
    if mode == "float":
        _log_once(logging.INFO, f"quantized linears: {QUANT_ACTIVATIONS_ENV}=float, float32 activations "
                                "against dequantized tiles")
        return None
    if not quant_dot_supported():
        _log_once(logging.WARNING, "quantized linears: no fused int8-activation kernel for this CPU (it needs "
                                   "AVX2); every step dequantizes tiles for a GEMM")
        return None
    _log_once(logging.INFO, f"quantized linears: fused int8-activation kernel ({quant_dot_isa()}) for Q4_0, "
                            "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K")
    return ggml_quant_matmul


QUANT_TILES_ENV = "PLUGINFER_QUANT_TILES"
# Rows of x up to which a GGML linear takes the fused int8-activation matmul, by the dtype of the tiles the
# rows above it dequantize to; measured on one core, benchmarks/quant_tiles.py --cpu-time (docs/performance.md).
# Against float32 tiles the fused kernel wins up to ~128 rows. Against bfloat16 tiles on the AMX GEMM the
# AVX-512 VNNI kernel wins up to ~48 (Q4_K, Q8_0, Q4_0: 0.86-1.1x at 48 rows, 1.0-1.4x at 64), and the AMX
# int8 kernel (amx_quant.py) up to ~128 for Q4_0 and Q4_K (0.92-1.0x at 128, 1.2x at 192) and ~256 for Q8_0
# (0.94-1.16x at 256, 1.14-1.33x at 384); Q6_K not measured, given Q4_K's.
QUANT_MATMUL_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 48}
# With bfloat16 tiles, for the GGML types the AMX int8 kernel takes (Q4_0, Q8_0, Q4_K, Q6_K).
AMX_INT8_MAX_ROWS = {2: 128, 8: 256, 12: 128, 14: 128}


def quant_matmul_max_rows(tile_dtype: torch.dtype) -> dict[int, int]:
    """GGML type -> the rows of x up to which ``ggml_blocks.ggml_linear`` takes the fused matmul, where the
    rows above it dequantize tiles to ``tile_dtype``."""
    limit = QUANT_MATMUL_MAX_ROWS[tile_dtype]
    if tile_dtype == torch.float32:
        return dict.fromkeys(QUANT_MATMUL_TYPES, limit)
    from pluginfer.backends import amx_quant

    return {qtype: AMX_INT8_MAX_ROWS[qtype] if amx_quant.takes(qtype, AMX_INT8_MAX_ROWS.get(qtype, 0)) else limit
            for qtype in QUANT_MATMUL_TYPES}
# Rows of float32 x from which tiles take that dtype (benchmarks/quant_tiles.py --cpu-time, float32 tiles
# against bfloat16: 0.9-1.3x as fast at 16-24 rows, 1.1-1.6x at 32, 1.3-1.7x at 48, 3.4-3.8x at 512).
TILE_DTYPE_MIN_ROWS = {torch.bfloat16: 32}


def bfloat16_gemm_is_fast() -> bool:
    """Whether torch's bfloat16 GEMM runs on AMX here (AMX-BF16 and oneDNN): several times its float32 GEMM."""
    return "amx_bf16" in cpu_features() and torch.backends.mkldnn.is_available()


def tile_dtype() -> torch.dtype:
    """The dtype the cpu backend's quantized linears dequantize their tiles to (the steps the fused int8
    kernel does not take): bfloat16 where :func:`bfloat16_gemm_is_fast`, else float32.
    ``PLUGINFER_QUANT_TILES`` (``auto``, ``float32``, ``bfloat16``) overrides it, and
    ``PLUGINFER_QUANT_ACTIVATIONS=float`` keeps float32 (the exact path). Says which, once per process."""
    mode = os.environ.get(QUANT_TILES_ENV, "auto").lower()
    if mode not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"{QUANT_TILES_ENV}={mode!r}: expected 'auto' (the default), 'float32' or 'bfloat16'")
    if os.environ.get(QUANT_ACTIVATIONS_ENV, "int8").lower() == "float":
        return torch.float32
    if mode == "float32" or (mode == "auto" and not bfloat16_gemm_is_fast()):
        why = f"{QUANT_TILES_ENV}=float32" if mode == "float32" else "no AMX-BF16 for torch's bfloat16 GEMM"
        _log_once(logging.INFO, f"quantized linears: tiles dequantized to float32 for torch's float32 GEMM ({why})")
        return torch.float32
    why = f"{QUANT_TILES_ENV}=bfloat16" if mode == "bfloat16" else "AMX-BF16"
    _log_once(logging.INFO, f"quantized linears: tiles dequantized to bfloat16 for torch's bfloat16 GEMM ({why}), "
                            f"from {TILE_DTYPE_MIN_ROWS[torch.bfloat16]} rows and past the fused kernel's "
                            f"{QUANT_MATMUL_MAX_ROWS[torch.bfloat16]} (128-256 on AMX int8 tiles); "
                            f"{QUANT_TILES_ENV}=float32 keeps float32 tiles")
    return torch.bfloat16


# What half_linear_supported() returns in C: the instruction set of the 16-bit GEMV.
HALF_LINEAR_ISAS = {1: "AVX512-BF16", 2: "AVX-512", 3: "AVX2 + F16C"}
HALF_LINEAR_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
# Rows above which half_linear hands the matmul back to torch's GEMM. Measured on this project's machine
# (docs/performance.md, benchmarks/half_gemv.py --cpu-time, the 0.5B llama's shapes): the kernel runs
# bfloat16 1.3-1.6x faster than torch's F.linear at 1-4 rows, 1.15-1.3x at 6, and ties torch's oneDNN
# GEMM (AMX on this CPU) from 7-8 rows; float16, where torch's GEMM is slower, ties at 16.
HALF_LINEAR_MAX_ROWS = {torch.bfloat16: 6, torch.float16: 16}


def half_linear_isa() -> str | None:
    """The instruction set the 16-bit GEMV runs with here (``csrc/half_linear.c``), or None where the
    library was built for a CPU without AVX2 + F16C."""
    return HALF_LINEAR_ISAS.get(load().half_linear_supported())


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``x @ W^T + bias`` for a bfloat16/float16 CPU weight ``[out, in]`` (the checkpoint's layout) and
    ``x [..., in]`` of its dtype (``csrc/half_linear.c``): products exact in float32, summed in float32,
    rounded once to ``x``'s dtype (``out_dtype=torch.float32``: not rounded). None: more rows than
    :data:`HALF_LINEAR_MAX_ROWS` gives for the dtype, or dtypes, devices or layouts it does not handle;
    use ``F.linear``."""
    dtype = weight.dtype
    if (dtype not in HALF_LINEAR_DTYPES or x.dtype != dtype or weight.dim() != 2 or x.dim() == 0
            or weight.device.type != "cpu" or x.device.type != "cpu" or not weight.is_contiguous()
            or x.shape[-1] != weight.shape[1] or out_dtype not in (None, dtype, torch.float32)
            or (bias is not None and (bias.dtype != dtype or bias.shape != (weight.shape[0],)
                                      or bias.device.type != "cpu"))):
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > HALF_LINEAR_MAX_ROWS[dtype] or rows == 0 or weight.shape[1] == 0:
        return None
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out_float = out_dtype == torch.float32
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32 if out_float else dtype)
    if bias is not None:
        bias = bias.contiguous()
    status = _lib().half_linear(HALF_LINEAR_DTYPES[dtype], flat.data_ptr(), rows, weight.shape[1], weight.data_ptr(),
                                weight.shape[0], bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                int(out_float))
    if status == -3:
        raise MemoryError("half_linear could not allocate its activation buffer")
    if status != 0:  # -4: no kernel on this CPU (op() does not hand it out there)
        raise ValueError(f"half_linear: status {status} for {dtype} weights {tuple(weight.shape)}")
    return out


def half_linear_op() -> Callable | None:
    """:func:`half_linear` where this CPU runs it, else None; says which, once per process."""
    isa = half_linear_isa()
    if isa is None:
        _log_once(logging.WARNING, "16-bit linears: no bfloat16/float16 GEMV for this CPU (it needs AVX2 + F16C); "
                                   "torch's matmul")
        return None
    limits = HALF_LINEAR_MAX_ROWS
    _log_once(logging.INFO, f"16-bit linears: native GEMV ({isa}) up to {limits[torch.bfloat16]} rows of bfloat16 "
                            f"and {limits[torch.float16]} of float16, torch's matmul above")
    return half_linear


def op(name: str) -> Callable | None:
    """The kernel for a layer op, or None; the panel ops need a CPU with AVX-512, the fused quantized
    matmul AVX2 (fastest with AVX-512 VNNI)."""
    if name in ("pack_panels", "panel_linear") and not load().panel_linear_supported():
        return None
    if name == "half_linear":
        return half_linear_op()
    kernel = OPS.get(name)
    if name in ("grouped_dequantize", "int4_dequantize"):
        dtype = tile_dtype()
        return kernel if dtype == torch.float32 else TileDequantize(kernel, dtype)
    if kernel is None or name not in ("ggml_quant_matmul", "ggml_dequantize"):
        return kernel
    quant_matmul = quant_matmul_op()
    if name == "ggml_quant_matmul":
        return quant_matmul
    dtype = tile_dtype()
    return kernel if quant_matmul is None and dtype == torch.float32 else GGMLDequantize(kernel, quant_matmul, dtype)


OPS = {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul, "rotary_neox": rotary_neox,
       "ggml_dequantize": ggml_dequantize, "grouped_dequantize": grouped_dequantize,
       "int4_dequantize": int4_dequantize, "pack_panels": pack_panels, "panel_linear": panel_linear,
       "ggml_quant_matmul": ggml_quant_matmul, "half_linear": half_linear}
