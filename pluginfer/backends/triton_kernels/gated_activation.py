"""``act(gate) * up`` over a merged ``[gate | up]`` row: ops ``silu_and_mul`` and ``gelu_and_mul``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SILU, _GELU, _GELU_TANH = 0, 1, 2
ACTIVATIONS = {"silu": _SILU, "gelu": _GELU, "gelu_tanh": _GELU_TANH}  # op fused_moe's names


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gated_kernel(x_ptr, out_ptr, stride_x, stride_o, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate_in = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    gate = gate_in.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        act = gate * tl.sigmoid(gate)
    elif ACTIVATION == 1:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        act = 0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    act = act.to(gate_in.dtype).to(tl.float32)  # torch rounds the activation before the product
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated(x: torch.Tensor, activation: int) -> torch.Tensor | None:
    if x.stride(-1) != 1 or x.shape[-1] % 2:
        return None
    n = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, 2 * n)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    _gated_kernel[(rows, triton.cdiv(n, block))](flat, out, flat.stride(0), n, n, ACTIVATION=activation, BLOCK=block)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    return gated(x, _SILU)


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor | None:
    return gated(x, _GELU_TANH if approximate == "tanh" else _GELU)
