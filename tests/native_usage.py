"""Which native kernel families a test run exercised, and whether this machine should have run them.

``install()`` (called from tests/conftest.py) wraps the functions of the cpu backend's C library, and
oneDNN's prepacked linear, so every call is counted: the terminal summary then says, per kernel family,
whether it ran. ``required(reason)`` tells the conftest whether a skip with that reason hides code this
machine can run: a C compiler and the CPU features a kernel needs are here, yet its test skipped (the
library did not load, a hard dependency is missing). Such a skip is turned into a failure.

Counts are the test processes' (under pytest-xdist each worker hands its counts to the controller); spawned
tensor-parallel ranks run the same kernels uncounted.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

# family -> (the C functions that are the family, the /proc/cpuinfo flags its fast path needs).
# The C guards: panel_linear.c needs __AVX512F__; quant_dot.c AVX-512 VNNI (with BW, VL, F16C) or, at least,
# AVX2 with FMA and F16C (its AVX2 kernels); half_linear.c and half_panel.c AVX2 with FMA and F16C at least; prefill_attention.c __AVX512F__.
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "decode attention": (("paged_decode_attention", "paged_decode_attention_kv16"), ()),
    "prefill attention (AVX-512)": (("paged_prefill_attention",), ("avx512f",)),
    "quantized KV attention": (("paged_attention_quantized", "kv_quantize_rows"), ()),
    "RMSNorm": (("rms_norm",), ()),
    "SiLU-and-mul": (("silu_and_mul",), ()),
    "GELU(tanh)-and-mul": (("gelu_tanh_and_mul", "gelu_tanh_and_mul_16"), ()),
    "rotary (neox)": (("rotary_neox",), ()),
    "panel GEMM (AVX-512)": (("pack_panels", "panel_linear"), ("avx512f",)),
    "GGML dequantize": (("ggml_dequantize_rows", "ggml_dequantize_rows_bf16"), ()),
    "GPTQ/AWQ dequantize": (("grouped_dequantize",), ()),
    "int4 dequantize": (("int4_dequantize_rows",), ()),
    "fused int8 GGML matmul (AVX2 / AVX-512 VNNI)": (("quant_matmul", "quant_panel_matmul"), ("avx2", "fma", "f16c")),
    "16-bit GEMV (AVX2 / AVX512-BF16)": (("half_linear", "half_weight_linear"), ("avx2", "fma", "f16c")),
    "16-bit panel GEMM (AVX2 / AVX-512)": (("pack_half_panels", "half_panel_linear"), ("avx2", "fma", "f16c")),
}
PANELS, FUSED = "panel GEMM (AVX-512)", "fused int8 GGML matmul (AVX2 / AVX-512 VNNI)"
HALF = "16-bit GEMV (AVX2 / AVX512-BF16)"
ONEDNN = "oneDNN prepacked GEMM (torch)"

calls: Counter[str] = Counter()  # C function or ONEDNN -> calls in this process (and its xdist workers')
_installed = False
_worker_library: list[str] = []  # the library lines of xdist workers (the controller runs no test)


def _counted(name: str, function: Callable) -> Callable:
    def call(*args: object) -> object:
        calls[name] += 1
        return function(*args)

    return call


def install() -> None:
    """Count calls into the native library (every library ``native_library.load()`` returns) and oneDNN's linear."""
    global _installed
    if _installed:
        return
    _installed = True
    from pluginfer.backends.cpu import library as native_library
    from pluginfer.backends.cpu import onednn

    unwrapped = native_library.load.__wrapped__
    counted_names = [name for functions, _ in FAMILIES.values() for name in functions]

    @functools.lru_cache(maxsize=1)
    def load():  # the ctypes.CDLL native_library.load returns
        library = unwrapped()
        for name in counted_names:
            if hasattr(library, name):  # a kernel another branch adds may be absent from this build
                setattr(library, name, _counted(name, getattr(library, name)))
        return library

    load.__doc__ = native_library.load.__doc__
    native_library.load = load  # tests call native_library.load.cache_clear(): it stays an lru_cache
    linear = onednn.linear

    def counted_linear(*args: object, **kwargs: object) -> object:
        calls[ONEDNN] += 1
        return linear(*args, **kwargs)

    onednn.linear = counted_linear


def ran(family: str) -> int:
    return sum(calls[name] for name in FAMILIES[family][0])


# --------------------------------------------------------------------------------------------------
# What this machine should run


def cpu_flags() -> frozenset[str]:
    from pluginfer.backends.cpu import build as native_build

    return native_build.cpu_features()


def compiler() -> str | None:
    name = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return shutil.which(name) if name else None


def native_excused() -> str | None:
    """Why this machine need not load the native library (None: it must)."""
    if os.environ.get("PLUGINFER_NATIVE") == "0":
        return "PLUGINFER_NATIVE=0 was set for this run"
    if compiler() is None:
        return "no C compiler (cc/gcc, or CC) on PATH"
    return None


def missing_flags(family: str) -> list[str]:
    return [flag for flag in FAMILIES[family][1] if flag not in cpu_flags()]


def onednn_available() -> bool:
    from pluginfer.backends.cpu import onednn

    return onednn.available()


def requirements() -> list[str]:
    """pluginfer's requirements and its ``test`` extra, from pyproject.toml beside these tests (the installed
    metadata of an editable install can be older), else from the installed distribution."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        import tomllib

        project = tomllib.loads(pyproject.read_text())["project"]
        return [*project["dependencies"], *project["optional-dependencies"]["test"]]
    except (ImportError, OSError, KeyError):  # Python 3.10, or tests run outside the checkout
        pass
    try:
        listed = importlib.metadata.requires("pluginfer") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [r for r in listed if ";" not in r or "extra" not in r or "test" in r.partition(";")[2]]


def distribution_name(requirement: str) -> str:
    return _normal(re.split(r"[\s<>=!~\[(;]", requirement.strip(), maxsplit=1)[0])


@functools.cache
def hard_dependencies() -> dict[str, str]:
    """Top-level module -> distribution, for pluginfer's requirements and its ``test`` extra (the README's test
    command installs both: a test that skips for lack of one hides code)."""
    from importlib.metadata import packages_distributions

    modules_of: dict[str, list[str]] = {}
    for module, distributions in packages_distributions().items():
        for distribution in distributions:
            modules_of.setdefault(_normal(distribution), []).append(module)
    wanted = {}
    for requirement in requirements():
        distribution = distribution_name(requirement)
        for module in modules_of.get(distribution, [distribution.replace("-", "_")]):
            wanted[module] = distribution
    return wanted


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_IMPORT = re.compile(r"could not import '([\w.]+)'")


# Skip reasons of the native tests -> the kernel family they need (None: the library alone).
NATIVE_SKIPS = {"native kernels unavailable": None, "needs the native library": PANELS, "fused kernel needs": FUSED,
                "16-bit GEMV needs": HALF}


# tests/server/web_chat/'s skip when no Chromium is found; CI installs Debian's (.ci/run).
NO_BROWSER = "no Chromium browser"


def required(reason: str) -> str | None:
    """For a skip reason: why this machine should have run the test (the skip becomes a failure), or None."""
    if NO_BROWSER in reason:
        if os.environ.get("CI"):
            return "CI installs Debian's chromium (.ci/run): the web chat page must be tested there"
        return None
    imported = _IMPORT.search(reason)
    if imported:
        module = imported.group(1).split(".")[0]
        distribution = hard_dependencies().get(module)
        if distribution is not None:
            return f"{distribution} is a dependency of pluginfer (pyproject.toml); install it"
        return None
    if "no oneDNN" in reason:
        return "torch reports oneDNN (torch.backends.mkldnn) available" if onednn_available() else None
    matched = [family for phrase, family in NATIVE_SKIPS.items() if phrase in reason]
    if not matched or native_excused() is not None:
        return None
    family = matched[0]
    if family is not None and missing_flags(family):
        return None
    needs = f" and the CPU features {family} needs ({', '.join(FAMILIES[family][1])})" if family else ""
    return (f"this machine has a C compiler ({compiler()}){needs}: the native library must load and its "
            f"kernels run here, not skip (the library: {_load_failure() or 'loads'})")


@functools.cache
def _load_failure() -> str | None:
    """Why the native library does not load (asked once: a failing build is not retried per test)."""
    from pluginfer.backends.cpu import ops as native

    return native.available()


def _library_line() -> str:
    from pluginfer.backends.cpu import library as native_library

    if "info" in native_library.loaded_build:
        info = native_library.loaded_build["info"]
        return (f"native library: loaded ({info.machine}, {'OpenMP' if info.openmp else 'single-threaded'}) "
                f"from {native_library.loaded_build['path']}")
    why = native_excused()
    return "native library: not loaded in this run" + (f" ({why})" if why else "")


def worker_output() -> dict:
    """What an xdist worker hands the controller at its end, for ``merge_worker``."""
    return {"native_calls": dict(calls), "native_library": _library_line()}


def merge_worker(output: dict) -> None:
    """Add an xdist worker's counts (``worker_output``) to this process's summary."""
    calls.update(output.get("native_calls", {}))
    if "native_library" in output:
        _worker_library.append(output["native_library"])


def summary_lines() -> list[str]:
    """The terminal summary: the library, then each family and whether it ran."""
    lines = [_library_line()]
    if _worker_library:  # under xdist: what the workers loaded, not the idle controller
        loaded = [line for line in _worker_library if line.startswith("native library: loaded")]
        lines = sorted(set(loaded or _worker_library))
    width = max(len(name) for name in [*FAMILIES, ONEDNN]) + 2
    for family in FAMILIES:
        count = ran(family)
        if count:
            state = f"ran ({count} calls)"
        elif missing_flags(family):
            state = f"not run: this CPU lacks {', '.join(missing_flags(family))}"
        else:
            state = "NOT RUN by the selected tests"
        lines.append(f"  {family:<{width}}{state}")
    count = calls[ONEDNN]
    state = f"ran ({count} calls)" if count else (
        "NOT RUN by the selected tests" if onednn_available() else "not run: this torch has no oneDNN")
    lines.append(f"  {ONEDNN:<{width}}{state}")
    lines.append("  (calls made in the test processes; spawned tensor-parallel ranks run the same kernels uncounted)")
    return lines
