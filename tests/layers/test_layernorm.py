"""LayerNorm (StableLM's) against torch.nn.LayerNorm, as transformers' StableLM builds it."""

from __future__ import annotations

import pytest
import torch

from pluginfer.backends.cpu.backend import CpuBackend
from pluginfer.layers.context import building
from pluginfer.layers.norm import LayerNorm
from tests.layers.conftest import make_context

HIDDEN, EPS = 96, 1e-5
# bf16: one bf16 step (rtol 2**-7), as for RMSNorm: the oracle and we may round at different steps.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2**-7)}


def build(backend: CpuBackend, dtype: torch.dtype, bias: bool) -> tuple[LayerNorm, torch.nn.LayerNorm]:
    generator = torch.Generator().manual_seed(0)
    weight = 1.0 + 0.5 * torch.randn(HIDDEN, generator=generator)
    shift = 0.5 * torch.randn(HIDDEN, generator=generator)
    with building(make_context(backend, dtype)):
        norm = LayerNorm(HIDDEN, EPS, bias=bias)
    oracle = torch.nn.LayerNorm(HIDDEN, eps=EPS, bias=bias)
    for module in (norm, oracle):
        module.weight.data.copy_(weight)
        if bias:
            module.bias.data.copy_(shift)
    assert norm.weight.dtype == dtype and (norm.bias is None) == (not bias)
    return norm, oracle.to(dtype)


def inputs(dtype: torch.dtype, *rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return ((3.0 * torch.randn(*rows, HIDDEN, generator=generator) + 1.0).to(dtype),
            torch.randn(*rows, HIDDEN, generator=generator).to(dtype))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [(1,), (33,), (3, 5)], ids=["one-token", "rows", "batched-3d"])
def test_layer_norm_matches_torch(cpu_backend: CpuBackend, dtype: torch.dtype, bias: bool, rows: tuple) -> None:
    norm, oracle = build(cpu_backend, dtype, bias)
    x, _ = inputs(dtype, *rows)
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, oracle(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_norm_with_residual_adds_then_normalizes(cpu_backend: CpuBackend, dtype: torch.dtype) -> None:
    norm, oracle = build(cpu_backend, dtype, bias=True)
    x, residual = inputs(dtype, 33)
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(out, oracle(x + residual), **TOLERANCE[dtype])


def test_layer_norm_needs_a_build_context() -> None:
    with pytest.raises(RuntimeError, match="building"):
        LayerNorm(HIDDEN)
