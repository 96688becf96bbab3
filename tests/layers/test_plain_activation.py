"""The plain (ungated) activations against transformers' ACT2FN (Phi-2's MLP uses gelu_new)."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from pluginfer.layers.activation import activation

NAMES = ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "relu"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden_act", NAMES)
def test_matches_transformers_act2fn(hidden_act: str, dtype: torch.dtype) -> None:
    x = (4.0 * torch.randn(7, 3, 40, generator=torch.Generator().manual_seed(0))).to(dtype)
    out = activation(hidden_act)(x)
    assert out.shape == x.shape and out.dtype == dtype
    # bf16: we round once, the oracle (float32 on the same inputs) not at all: half a bf16 step.
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=2**-8)
    torch.testing.assert_close(out.float(), ACT2FN[hidden_act](x.float()), **tolerance)


@pytest.mark.parametrize("hidden_act", ["gelu_10", "Relu", "tanh"])
def test_unknown_activation_is_an_error_naming_hidden_act(hidden_act: str) -> None:
    with pytest.raises(ValueError, match=rf"hidden_act.*'{hidden_act}'"):
        activation(hidden_act)
