"""The ``gloo`` (CPU tensors) and ``nccl`` (CUDA tensors) collectives over ``torch.distributed``.

Both are the core's ``TorchDistributedCollective`` (``pluginfer/layers/torch_collective.py``: rendezvous,
timeouts, groups, objects, traffic counters) joined over their library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pluginfer.layers.torch_collective import TorchDistributedCollective, join

if TYPE_CHECKING:
    from pluginfer.core.config import EngineConfig
    from pluginfer.core.protocols import RankInfo

__all__ = ["TorchDistributedCollective", "build_gloo", "build_nccl", "gloo_unavailable", "nccl_unavailable"]


def build_gloo(config: EngineConfig, rank: RankInfo) -> TorchDistributedCollective:
    """The ``gloo`` plugin: CPU tensors, any number of ranks on one or several machines."""
    return join("gloo", config, rank, torch.device("cpu"))


def build_nccl(config: EngineConfig, rank: RankInfo) -> TorchDistributedCollective:
    """The ``nccl`` plugin: tensors on ``cuda:{rank.local_rank}``, which becomes this process's device."""
    reason = nccl_unavailable()
    if reason is not None:
        raise RuntimeError(f"collective nccl cannot run here: {reason}")
    device = torch.device("cuda", rank.local_rank)
    torch.cuda.set_device(device)
    return join("nccl", config, rank, device, gather_into_tensor=True, bind_device=True)


def gloo_unavailable() -> str | None:
    """Availability check of ``gloo``: None when usable, else why not."""
    if not dist.is_available():
        return "torch was built without torch.distributed"
    if not dist.is_gloo_available():
        return "torch was built without the gloo backend"
    return None


def nccl_unavailable() -> str | None:
    """Availability check of ``nccl``: None when usable, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not dist.is_available() or not dist.is_nccl_available():
        return "torch was built without NCCL"
    return None
