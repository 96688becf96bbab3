"""The ``gcu`` backend: tensors and the paged KV cache on ``gcu:{local_rank}``, attention through pluginfer's
kernel table. No GCU kernels yet: every op runs its torch reference (``pluginfer.layers.ops``, ``attention_ops``) on the
device; a vendor kernel enters with ``GcuBackend.kernels.register(op, implementation)``. Everything but the
device and the collective is ``BaseDeviceBackend``'s (free memory from ``torch.gcu.mem_get_info``)."""

from __future__ import annotations

import torch

from pluginfer.core.protocols import RankInfo
from pluginfer.layers.backend_base import BaseDeviceBackend
from pluginfer_gcu import device as gcu


class GcuBackend(BaseDeviceBackend):
    """One GCU; ``device`` overrides it (tests run it on the CPU)."""

    name = "gcu"
    default_collective = "eccl"
    quant_kernels_required = False  # formats without a kernel here take their torch path

    def __init__(self, config: object = None, rank: RankInfo | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__(device if device is not None else gcu.rank_device((rank or RankInfo()).local_rank))


def build(config: object = None, rank: RankInfo | None = None) -> GcuBackend:
    reason = gcu.why_not_usable()
    if reason is not None:
        raise RuntimeError(f"backend gcu cannot run here: {reason}")
    return GcuBackend(config, rank)
