"""The metal backend: Apple GPUs through PyTorch's ``mps`` device, torch attention over gathered pages.

No custom kernels: attention is the cpu backend's torch path (gather each sequence's keys from its
blocks, one scaled-dot-product attention for the decode rows and one for the prefill rows), run by
composition with every tensor it creates placed on the ``mps`` device. float32, float16 and bfloat16
(bfloat16 needs macOS 14). One rank: no collective carries MPS tensors.

Never run on Apple hardware yet: on this project's machines it is tested with its device set to the CPU.
"""

from __future__ import annotations

import torch

from pluginfer.backends.cpu.backend import CpuAttentionMetadata, CpuBackend
from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import RankInfo
from pluginfer.layers.backend_base import BaseDeviceBackend


def why_not_usable() -> str | None:
    """The spec's check: None when an MPS device is usable here, else why not."""
    if not torch.backends.mps.is_available():
        return "no MPS device" if torch.backends.mps.is_built() else "no MPS device (torch was built without MPS)"
    return None


class MetalBackend(BaseDeviceBackend):
    """The ``mps`` device; ``device`` overrides it (tests run it on the CPU).

    KV cache allocation, block copies, ``op`` (no kernels: every layer keeps its torch path), ``capture_decode``
    and ``synchronize`` are ``BaseDeviceBackend``'s; attention and the memory budget are the cpu backend's
    torch path, run with every tensor it creates on this device."""

    name = "metal"
    quant_kernels_required = False  # formats without a kernel here take their torch path

    def __init__(self, config: object = None, rank: RankInfo | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__(device or torch.device("mps"))
        self._torch_path = CpuBackend(config, rank, native_kernels=False)

    def kv_cache_budget_bytes(self, requested: int | None, fraction: float) -> int:
        if requested is not None:
            return requested
        if self.device.type == "mps":
            free = torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
            return int(max(free, 0) * fraction)
        return self._torch_path.kv_cache_budget_bytes(None, fraction)

    def prepare(self, batch: ForwardBatch) -> CpuAttentionMetadata:
        with torch.device(self.device):
            return self._torch_path.prepare(batch)

    def paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, scale: float,
                        sliding_window: int | None = None, logit_soft_cap: float | None = None) -> torch.Tensor:
        with torch.device(self.device):  # masks built lazily here land on the device too
            return self._torch_path.paged_attention(query, key, value, kv_cache, batch, scale, sliding_window,
                                                    logit_soft_cap)


def build(config: object = None, rank: RankInfo | None = None) -> MetalBackend:
    reason = why_not_usable()
    if reason is not None:
        raise RuntimeError(f"backend metal cannot run here: {reason}")
    if rank is not None and rank.world_size > 1:
        raise ValueError(f"backend metal runs one rank (no collective carries MPS tensors), not {rank.world_size}: "
                         "set parallel.tensor_parallel_size and parallel.pipeline_parallel_size to 1")
    return MetalBackend(config, rank)
