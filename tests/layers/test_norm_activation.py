"""RMSNorm against transformers' LlamaRMSNorm / GemmaRMSNorm; gated activations against ACT2FN.

Layers are built with the cpu backend, once with its native kernels and once with its torch path.
"""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pluginfer.backends.cpu.backend import CpuBackend
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.activation import GeluAndMul, SiluAndMul, gated_activation
from pluginfer.layers.context import building
from pluginfer.layers.norm import RMSNorm
from tests.layers.conftest import make_context

HIDDEN, EPS = 96, 1e-5
# bf16 keeps 8 significant bits: adjacent values differ by 2**-8..2**-7 relative. Our norm and the oracle
# (run in bf16, as a bf16 model runs it) may round at different steps, so allow one bf16 step: rtol 2**-7.
TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-6, rtol=2**-7)}


@pytest.fixture
def backend(cpu_backend: CpuBackend) -> CpuBackend:
    return cpu_backend


def context(backend: CpuBackend, dtype: torch.dtype) -> BuildContext:
    return make_context(backend, dtype)


def random_weight(seed: int) -> torch.Tensor:
    return 1.0 + 0.5 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))


def build_norm(backend: CpuBackend, dtype: torch.dtype, offset: float, weight: torch.Tensor) -> RMSNorm:
    with building(context(backend, dtype)):
        norm = RMSNorm(HIDDEN, EPS, offset=offset)
    assert norm.weight.dtype == dtype
    norm.weight.data.copy_(weight)
    return norm


def oracle_norm(dtype: torch.dtype, offset: float, weight: torch.Tensor) -> torch.nn.Module:
    oracle = LlamaRMSNorm(HIDDEN, eps=EPS) if offset == 0 else GemmaRMSNorm(HIDDEN, eps=EPS)
    oracle.weight.data.copy_(weight)
    return oracle.to(dtype)  # as a model loaded in dtype: the weight is stored in dtype


def inputs(dtype: torch.dtype, *rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = 3.0 * torch.randn(*rows, HIDDEN, generator=generator)
    residual = torch.randn(*rows, HIDDEN, generator=generator)
    return x.to(dtype), residual.to(dtype)


ROWS = {"one-token": (1,), "rows": (33,), "batched-3d": (3, 5)}


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma-offset"])
def test_rms_norm_matches_transformers(backend: CpuBackend, dtype: torch.dtype, offset: float, rows: str) -> None:
    weight = random_weight(seed=2)
    norm, oracle = build_norm(backend, dtype, offset, weight), oracle_norm(dtype, offset, weight)
    x, _ = inputs(dtype, *ROWS[rows])
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, oracle(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma-offset"])
def test_rms_norm_with_residual_adds_then_normalizes(backend: CpuBackend, dtype: torch.dtype,
                                                     offset: float) -> None:
    """The decoder-layer pattern: ``residual = x + residual`` (in dtype, as HF does), then the norm of it.

    The returned residual is what counts (the native kernel updates the argument in place).
    """
    weight = random_weight(seed=3)
    norm, oracle = build_norm(backend, dtype, offset, weight), oracle_norm(dtype, offset, weight)
    x, residual = inputs(dtype, 33)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = norm(x, residual)
    expected_residual = x_before + residual_before
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, oracle(expected_residual), **TOLERANCE[dtype])
    assert out.dtype == dtype and new_residual.dtype == dtype


def test_rms_norm_of_strided_rows(backend: CpuBackend) -> None:
    """Rows picked out of a wider tensor (not contiguous) take whatever path handles them, correctly."""
    weight = random_weight(seed=5)
    norm, oracle = build_norm(backend, torch.float32, 0.0, weight), oracle_norm(torch.float32, 0.0, weight)
    wide, residual_wide = inputs(torch.float32, 9, 2)
    x, residual = wide[:, 1], residual_wide[:, 0]
    assert not x.is_contiguous()
    torch.testing.assert_close(norm(x), oracle(x), **TOLERANCE[torch.float32])
    out, new_residual = norm(x.clone(), residual)
    torch.testing.assert_close(new_residual, x + residual_wide[:, 0], **TOLERANCE[torch.float32])
    torch.testing.assert_close(out, oracle(x + residual_wide[:, 0]), **TOLERANCE[torch.float32])


def test_rms_norm_needs_a_build_context() -> None:
    with pytest.raises(RuntimeError, match="building"):
        RMSNorm(HIDDEN)


GATED = {"silu": "silu", "swish": "swish", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_pytorch_tanh",
         "gelu_new": "gelu_new", "gelu_fast": "gelu_fast"}


# bf16 activations: the oracle runs in float32 on the same bf16 inputs (HF's gelu_new/gelu_fast spell the tanh
# formula out op by op, and in bf16 each op rounds; that is the oracle's error, not ours). We round twice
# (activation, product), half a bf16 step each: rtol 2**-7; atol for values that underflow near zero.
# fp32: torch's own vectorized and strided erf GELU kernels differ by ~1e-6, hence atol 1e-5.
ACTIVATION_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-5, rtol=2**-7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden_act", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"])
def test_gated_activation_matches_transformers_act2fn(backend: CpuBackend, hidden_act: str,
                                                     dtype: torch.dtype) -> None:
    """``act(gate) * up`` on ``[gate | up]``, as HF's MLP computes ``act_fn(gate_proj(x)) * up_proj(x)``."""
    with building(context(backend, dtype)):
        activation = gated_activation(hidden_act)
    generator = torch.Generator().manual_seed(4)
    gate = (4.0 * torch.randn(5, 3, 48, generator=generator)).to(dtype)
    up = torch.randn(5, 3, 48, generator=generator).to(dtype)
    out = activation(torch.cat([gate, up], dim=-1))
    expected = ACT2FN[hidden_act](gate.float()) * up.float()
    assert out.shape == up.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **ACTIVATION_TOLERANCE[dtype])


@pytest.mark.parametrize("layout", ["rows", "one-row", "strided"])
def test_activation_classes_directly(backend: CpuBackend, layout: str) -> None:
    wide = 6.0 * torch.randn(33, 2, 40, generator=torch.Generator().manual_seed(6))
    x = {"rows": wide[:, 0].contiguous(), "one-row": wide[:1, 0], "strided": wide[:, :, :20].transpose(0, 1)}[layout]
    gate, up = x.chunk(2, dim=-1)
    with building(context(backend, torch.float32)):
        silu, gelu, gelu_tanh = SiluAndMul(), GeluAndMul(), GeluAndMul("tanh")
    torch.testing.assert_close(silu(x), ACT2FN["silu"](gate) * up, **ACTIVATION_TOLERANCE[torch.float32])
    torch.testing.assert_close(gelu(x), ACT2FN["gelu"](gate) * up, **ACTIVATION_TOLERANCE[torch.float32])
    torch.testing.assert_close(gelu_tanh(x), ACT2FN["gelu_pytorch_tanh"](gate) * up,
                               **ACTIVATION_TOLERANCE[torch.float32])


@pytest.mark.parametrize("hidden_act", ["relu", "gelu_10", "Silu"])
def test_unknown_activation_is_an_error_naming_hidden_act(hidden_act: str) -> None:
    with pytest.raises(ValueError, match=rf"hidden_act.*'{hidden_act}'"):
        gated_activation(hidden_act)
