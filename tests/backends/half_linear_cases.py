"""Inputs and the exact oracle shared by the tests of the 16-bit weight linears (test_native_half_linear.py,
test_native_half_weight_linear.py, test_native_amx_half.py)."""

from __future__ import annotations

import torch


def inputs(rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int, with_bias: bool,
           activations: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x ``[rows, in]`` and the bias in ``activations`` (default: ``dtype``, the weight's), the weight
    ``[out, in]`` scaled by ``in ** -0.5``; x, weight, bias drawn in that order from ``seed``."""
    activations = dtype if activations is None else activations
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).to(activations)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(activations) if with_bias else None
    return x, weight, bias


def exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result (float64: at most 2^11-bit products, short sums) and S = sum |x_i w_i| + |bias|."""
    x64, w64 = x.double(), weight.double()
    value, size = x64 @ w64.T, x64.abs() @ w64.abs().T
    if bias is not None:
        value, size = value + bias.double(), size + bias.double().abs()
    return value, size


def plant_nonfinite(x: torch.Tensor, weight: torch.Tensor) -> None:
    """In place: a NaN in x's row 1 and an infinity in row 2 (x of at least 3 x 11), a -inf in weight row 7 and a NaN
    in row 9 (weight of at least 10 x 21)."""
    x[1, 3] = float("nan")
    x[2, 10] = float("inf")
    weight[7, 20] = float("-inf")
    weight[9, 0] = float("nan")


def assert_nonfinite_as_exact(out: torch.Tensor, value: torch.Tensor) -> None:
    """NaN and infinities of ``out`` exactly where the exact ``value`` has them, the infinities of the same sign."""
    assert torch.equal(out.isnan(), value.isnan())
    assert torch.equal(out.isinf(), value.isinf()) and torch.equal(out[out.isinf()], value[value.isinf()].to(out.dtype))
