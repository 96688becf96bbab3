"""Fixtures shared by the native kernel tests of this folder."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native


@pytest.fixture(scope="module")
def native_kernels() -> None:
    """For modules about the native kernels (``pytestmark = pytest.mark.usefixtures("native_kernels")``):
    skipped where they do not load; where the machine can build them, tests/conftest.py makes that skip a
    failure."""
    reason = native.available()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}-thread")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's (and so the native kernels') thread count for the test: 1 and 2, or as a test's indirect
    parametrization says."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    # The library links libgomp by soname and torch loaded its own libgomp.so.1 first: one runtime, so
    # torch's setting is the kernels' (omp_get_max_threads resolved through the kernel library's handle).
    openmp = native_library.loaded_build["info"].openmp
    assert native_library.load().omp_get_max_threads() == (request.param if openmp else 1)
    yield request.param
    torch.set_num_threads(previous)


@pytest.fixture
def set_threads() -> Iterator[Callable[[int], None]]:
    """``torch.set_num_threads`` for a test that changes the thread count as it goes; restored after it."""
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)
