"""The cpu backend's GELU(tanh)-and-mul kernels (``gelu_tanh_and_mul`` and ``gelu_tanh_and_mul_16`` in
csrc/activation.c, Gemma's activation) against torch's ``F.gelu(gate, approximate="tanh") * up``.

The kernel computes 0.5 g (1 + tanh(u)) as g / (1 + exp(-2u)) with its own expf (exp512); torch computes
1 + tanh(u) literally, which keeps only an absolute accuracy of about 2^-24 there (for u below about -2 the
sum is much smaller than 1): both are within 2.5 x 2^-24 |gate x up| of the float64 value on the inputs
below (measured), so the bound is ``2^-22 |gate x up|`` plus, in float32, 2 units in the last place of
torch's result, and in 16 bits one unit of torch's rounded gelu times |up| plus one unit of the result
(the kernel rounds where torch rounds: gelu(gate), then the product; a gelu that lands on the other side
of a rounding boundary carries through the product). The erf form is left to torch (the wrapper returns
None). At 1 and 2 threads, rows past and below the parallel branch (2**13 values on more than one row), odd
widths (the scalar tail).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import layer_ops as native_layer_ops
from pluginfer.backends.cpu import ops as native

pytestmark = pytest.mark.usefixtures("native_kernels")  # threads: tests/backends/conftest.py, 1 and 2


def gated_inputs(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, 2n] of gate | up, magnitudes 2^-3 to 2^4 (gelu's curved part, its linear and its vanishing
    tail), with an infinity of each sign and a NaN in the gate, and a zero in up."""
    generator = torch.Generator().manual_seed(seed)
    scales = 2.0 ** torch.randint(-3, 5, (rows, 2 * n), generator=generator)
    x = (torch.randn(rows, 2 * n, generator=generator) * scales).to(dtype)
    x[0, 0], x[0, 1], x[-1, n - 1], x[-1, n] = float("inf"), float("-inf"), float("nan"), 0.0
    return x


def assert_within_bound(out: torch.Tensor, x: torch.Tensor) -> None:
    gate, up = x.chunk(2, dim=-1)
    gelu = F.gelu(gate, approximate="tanh")
    expected = gelu * up
    assert out.dtype == x.dtype and out.shape == expected.shape
    a, b = out.double(), expected.double()
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a[b.isinf()], b[b.isinf()])
    finite = b.isfinite()
    info = torch.finfo(x.dtype)
    if x.dtype == torch.float32:
        bound = 2 * info.eps * b.abs()
    else:  # one unit of the rounded gelu through the product, one of the result (subnormals: their spacing)
        bound = info.eps * (gelu.double().abs() * up.double().abs() + b.abs()) + info.eps * info.tiny
    bound = bound + 2.0**-22 * (gate.double() * up.double()).abs()
    error = (a - b).abs()[finite]
    assert bool((error <= bound[finite]).all()), float((error / bound[finite].clamp_min(1e-300)).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "n"), [(1, 1000), (3, 7), (6, 4099), (9, 16)])
def test_gelu_tanh_and_mul_within_the_bound_of_torch(dtype: torch.dtype, rows: int, n: int, threads: int) -> None:
    x = gated_inputs(rows, n, dtype, seed=rows * n)
    out = native_layer_ops.gelu_and_mul(x, "tanh")
    assert out is not None
    assert_within_bound(out, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant(dtype: torch.dtype) -> None:
    """A row's result is the same bits alone and among others (serial and parallel branches)."""
    x = gated_inputs(8, 1100, dtype, seed=5)  # 8800 values: the parallel branch at 2 threads
    together = native_layer_ops.gelu_and_mul(x, "tanh")
    for row in range(x.shape[0]):
        alone = native_layer_ops.gelu_and_mul(x[row:row + 1].clone(), "tanh")
        assert torch.equal(alone.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           together[row:row + 1].view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_the_erf_form_and_unsupported_inputs_take_the_torch_path() -> None:
    x = gated_inputs(2, 32, torch.float32, seed=1)
    assert native_layer_ops.gelu_and_mul(x, "none") is None
    assert native_layer_ops.gelu_and_mul(x.double(), "tanh") is None
    assert native_layer_ops.gelu_and_mul(x[:, ::2], "tanh") is None  # not contiguous
    assert native.op("gelu_and_mul") is native_layer_ops.gelu_and_mul
