"""Native CPU kernels: C compiled on first use with the system compiler, loaded through ctypes.

No torch headers are needed, so the build takes about a second. When no compiler is found (or
``PLUGINFER_NATIVE=0``) the cpu backend keeps its torch path; `pluginfer plugins` says which.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class NativeKernelsUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here; the reason says why."""


def _cache_dir() -> Path:
    root = Path(os.environ.get("PLUGINFER_CACHE", Path.home() / ".cache" / "pluginfer"))
    return root / "native"


def _build(source: Path, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeKernelsUnavailable("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as staging:
        staging_path = Path(staging.name)
    result = subprocess.run([compiler, *FLAGS, str(source), "-o", str(staging_path), "-lm"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        staging_path.unlink(missing_ok=True)
        raise NativeKernelsUnavailable(f"compiling {source.name} failed: {result.stderr.strip()[:500]}")
    staging_path.replace(target)  # atomic: concurrent builders never load a half-written file


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The compiled kernel library (built once per source version and machine)."""
    if os.environ.get("PLUGINFER_NATIVE", "1") == "0":
        raise NativeKernelsUnavailable("disabled by PLUGINFER_NATIVE=0")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode() + os.uname().machine.encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{digest}.so"
    if not target.is_file():
        _build(SOURCE, target)
    library = ctypes.CDLL(str(target))
    function = library.paged_decode_attention
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int64,
                                                                         ctypes.c_float]
    return library


def available() -> str | None:
    """None when the kernels load, else the reason they do not."""
    try:
        load()
    except (NativeKernelsUnavailable, OSError) as exc:
        return str(exc)
    return None


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """float32 decode attention over the paged cache; query ``[seqs, heads, dim]``."""
    query = query.contiguous()
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, v_dim = value_cache.shape
    out = torch.empty(num_seqs, num_heads, v_dim, dtype=torch.float32)
    status = load().paged_decode_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, v_dim, block_size,
        block_tables.shape[1], scale, sliding_window or 0, soft_cap or 0.0,
    )
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its score buffer")
    return out
