"""The cpu backend's dense-weight layouts: ops ``dense_layout``, ``dense_pack`` and ``dense_linear``.

The checkpoint's ``[out, in]`` is replaced once by what the fastest available kernel reads: ``panels``
(``csrc/panel_linear.c``, float32 on AVX-512), ``onednn`` (oneDNN's prepacked layout, batched engines without
it), ``half`` (16-bit weights for the native GEMV, ``F.linear`` past ``HALF_LINEAR_MAX_ROWS``), ``transposed``
(``[in, out]`` for MKL's GEMV) or ``checkpoint`` (weights off the CPU). The weight is held once; layers reach
these through the kernel table (``layers/dense.py``) and nothing outside this backend knows the layouts.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import half_linear, onednn, ops, panels
from pluginfer.backends.cpu.library import log_once


class CpuDenseLayouts:
    """The three ops for one cpu backend; whether the native panels are used is read from the backend
    at each choice (tests switch its ``native_kernels`` off after building it)."""

    def __init__(self, backend: object) -> None:
        self.backend = backend

    def _panels(self) -> bool:
        if not self.backend.native_kernels:
            return False
        if ops.op("panel_linear") is None:
            log_once(logging.INFO, "float32 linears: no native panel GEMM (it needs AVX-512F); oneDNN's "
                                    "prepacked GEMM when batched, MKL's otherwise")
            return False
        return True

    def _half_linear(self) -> bool:
        """Whether 16-bit weights take the native GEMV (says which path once, when first asked)."""
        return bool(self.backend.native_kernels) and ops.op("half_linear") is not None

    def dense_layout(self, weight: torch.Tensor, batched: bool, packed_only: bool) -> str:
        if weight.device.type != "cpu":
            return "checkpoint"
        if weight.dtype == torch.float32:
            if self._panels():
                return "panels"
            if onednn.worth_packing(weight, batched):
                return "onednn"
        if weight.dtype in half_linear.HALF_LINEAR_DTYPES and not packed_only and self._half_linear():
            return "half"
        return "checkpoint" if packed_only else "transposed"

    def dense_pack(self, weight: torch.Tensor, layout: str) -> torch.Tensor:
        if layout == "panels":
            return panels.pack_panels(weight)
        if layout == "onednn":
            return onednn.pack(weight)
        if layout == "transposed":
            return weight.t().contiguous()
        if layout == "half":
            return weight.contiguous()
        if layout == "checkpoint":
            return weight
        raise ValueError(f"cpu backend: no dense layout named {layout!r}")

    def dense_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str,
                     out_features: int) -> torch.Tensor:
        if layout == "panels":
            return panels.panel_linear(x, weight, out_features, bias)
        if layout == "onednn":
            return onednn.linear(x, weight, bias)
        if layout == "half":
            out = half_linear.half_linear(x, weight, bias)
            return F.linear(x, weight, bias) if out is None else out
        if layout == "checkpoint":
            return F.linear(x, weight, bias)
        if bias is None:
            return torch.matmul(x, weight)
        return torch.addmm(bias, x, weight) if x.dim() == 2 else torch.matmul(x, weight) + bias
