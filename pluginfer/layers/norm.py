"""RMSNorm, with the residual add fused in (one pass instead of two)."""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.layers.context import backend_op, current_context


class RMSNorm(nn.Module):
    """``x / rms(x) * w`` computed in float32; ``offset=1`` gives Gemma's ``(1 + w)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        ctx = current_context()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.eps, self.offset = eps, offset
        self.kernel = backend_op(ctx.backend, "rms_norm")

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.float() + self.offset if self.offset else self.weight
        if dtype == torch.float32:
            return x * weight
        return (x * weight.float()).to(dtype) if self.offset else x.to(dtype) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None:
            if residual is None and not x.is_contiguous():  # q/k norms of a view into the fused qkv output
                # (one copy: the kernel then takes every batch size, and a decode step replays)
                x = x.contiguous()
            out = self.kernel(x, residual, self.weight, self.eps, self.offset)  # residual updated in place
            if out is not None:
                return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class LayerNorm(nn.Module):
    """``(x - mean) / std * w + b`` computed in float32 (inside torch's kernel), with the same fused residual add
    as RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        ctx = current_context()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=ctx.dtype), requires_grad=False) if bias else None
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:  # torch's kernel accumulates 16-bit inputs in float32
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
