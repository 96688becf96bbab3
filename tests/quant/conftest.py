"""Fixtures of the tensor-parallel quant tests (``pytestmark = pytest.mark.usefixtures(...)`` in each module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread_per_rank() -> Iterator[None]:
    """The thread ranks share torch's intra-op pool; one thread each keeps them from fighting over it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def float32_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dense_weight`` reads a layer's weight back exactly by multiplying the identity (``input_size`` rows):
    float32 tiles and the float32 tiles' row limit for the fused kernel, as every rank count must see the
    same path. bfloat16 tiles (an AMX-BF16 CPU, docs/quantization.md) round the product, and with them
    the 4-rank row layer's 256 identity rows would take the fused kernel while one rank's 1024 take tiles."""
    monkeypatch.setenv("PLUGINFER_QUANT_TILES", "float32")
