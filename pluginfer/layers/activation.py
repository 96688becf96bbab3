"""Gated activations over a merged gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.layers.context import backend_op, current_context, has_context


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input is ``[gate | up]`` on the last axis."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = backend_op(current_context().backend, "silu_and_mul") if has_context() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            out = self.kernel(x)
            if out is not None:
                return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu(gate) * up`` (tanh approximation when asked, as Gemma's gelu_pytorch_tanh)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate
        self.kernel = backend_op(current_context().backend, "gelu_and_mul") if has_context() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            out = self.kernel(x, self.approximate)
            if out is not None:
                return out
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


def gated_activation(hidden_act: str) -> nn.Module:
    """The gated activation for an HF ``hidden_act`` value; unknown names are an error."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return GeluAndMul("tanh")
    if hidden_act == "gelu":
        return GeluAndMul()
    raise ValueError(f"hidden_act: unsupported activation {hidden_act!r} (supported: silu, gelu, gelu_pytorch_tanh)")


def activation(hidden_act: str) -> nn.Module:
    """The plain (ungated) activation for an HF ``hidden_act`` value, e.g. Phi-2's ``fc2(act(fc1(x)))``."""
    if hidden_act in ("silu", "swish"):
        return nn.SiLU()
    if hidden_act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return nn.GELU(approximate="tanh")
    if hidden_act == "gelu":
        return nn.GELU()
    if hidden_act == "relu":
        return nn.ReLU()
    raise ValueError(f"hidden_act: unsupported activation {hidden_act!r} "
                     "(supported: silu, gelu, gelu_pytorch_tanh, gelu_new, gelu_fast, relu)")
