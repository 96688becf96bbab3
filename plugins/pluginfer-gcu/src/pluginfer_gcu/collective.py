"""The ``eccl`` collective: pluginfer's ``TorchDistributedCollective`` over the ECCL process group that
``torch_gcu`` registers with ``torch.distributed`` (the core's class, so rendezvous, timeouts, groups, object
transfer and traffic counters are pluginfer's own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pluginfer.layers.torch_collective import TorchDistributedCollective, join
from pluginfer_gcu import device as gcu

if TYPE_CHECKING:
    from pluginfer.core.config import EngineConfig
    from pluginfer.core.protocols import RankInfo

LIBRARY = "eccl"


def why_not_usable() -> str | None:
    """None when torch_gcu loads, sees a GCU and has registered ECCL with torch.distributed."""
    reason = gcu.why_not_usable()
    if reason is not None:
        return reason
    if not dist.is_available() or not dist.is_backend_available(LIBRARY):
        return "torch_gcu did not register the eccl process group with torch.distributed"
    return None


def join_group(config: EngineConfig, rank: RankInfo, device: torch.device,
               library: str = LIBRARY) -> TorchDistributedCollective:
    """Join the world over ``library`` with tensors on ``device`` (tests pass gloo and the CPU)."""
    # ECCL mirrors NCCL's API: one all_gather_into_tensor; the device is chosen before, not passed to torch.
    return join(library, config, rank, device, gather_into_tensor=True)


def build(config: EngineConfig, rank: RankInfo) -> TorchDistributedCollective:
    reason = why_not_usable()
    if reason is not None:
        raise RuntimeError(f"collective eccl cannot run here: {reason}")
    return join_group(config, rank, gcu.rank_device(rank.local_rank))
