"""Layers run on both paths of the cpu backend: the native kernels and the torch reference."""

from __future__ import annotations

import pytest
import torch

from pluginfer.backends.cpu import backend as cpu
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu.backend import CpuBackend
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext
from pluginfer.quant import unquantized


@pytest.fixture(params=["native", "torch"])
def cpu_backend(request: pytest.FixtureRequest) -> CpuBackend:
    backend = cpu.build()
    if request.param == "native" and not backend.native_kernels:
        pytest.skip(f"native kernels unavailable: {native.available()}")
    backend.native_kernels = request.param == "native"
    return backend


# The native panel GEMM (backends/csrc/panel_linear.c) needs the native library on an AVX-512 CPU.
PANELS_AVAILABLE = native.available() is None and native.op("panel_linear") is not None


def backend_with(native_kernels: bool) -> CpuBackend:
    """A cpu backend that offers its native kernels only when asked to (and able)."""
    backend = cpu.build()
    backend.native_kernels = backend.native_kernels and native_kernels
    return backend


def make_context(backend: CpuBackend, dtype: torch.dtype = torch.float32, max_model_len: int = 128) -> BuildContext:
    return BuildContext(backend=backend, quant=unquantized.build(), collective=single.build(), dtype=dtype,
                        max_model_len=max_model_len)
