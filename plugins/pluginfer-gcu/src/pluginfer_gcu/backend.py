"""The ``gcu`` backend: tensors and the paged KV cache on ``gcu:{local_rank}``, attention through pluginfer's
kernel table. No GCU kernels yet: every op runs its torch reference (``pluginfer.core.kernels``) on the
device; a vendor kernel enters with ``GcuBackend.kernels.register(op, implementation)``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pluginfer.core import kernels
from pluginfer.core.batch import ForwardBatch
from pluginfer.core.kernels import KernelTable, PagedAttentionMetadata
from pluginfer.core.protocols import KVCacheSpec, RankInfo
from pluginfer_gcu import device as gcu


class GcuBackend:
    """One GCU; ``device`` overrides it (tests run it on the CPU)."""

    name = "gcu"
    default_collective = "eccl"
    quant_kernels_required = False  # formats without a kernel here take their torch path

    def __init__(self, config: object = None, rank: RankInfo | None = None,
                 device: torch.device | None = None) -> None:
        self.device = device if device is not None else gcu.rank_device((rank or RankInfo()).local_rank)
        self.kernels = KernelTable(self.name)

    def capture_decode(self, forward: object, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        """No replays here (``DeviceBackend.capture_decode``): every step runs eagerly."""
        return None

    def op(self, name: str) -> Callable | None:
        return self.kernels.implementation(name)  # None for now: layers keep their torch path

    def kv_cache_budget_bytes(self, requested: int | None, fraction: float) -> int:
        if requested is not None:
            return requested
        mem_get_info = getattr(getattr(torch, gcu.DEVICE_TYPE, None), "mem_get_info", None)
        if mem_get_info is None:
            raise ValueError("backend gcu: torch_gcu reports no free memory (torch.gcu.mem_get_info); set "
                             "cache.kv_cache_memory (e.g. 8GiB) or cache.num_blocks")
        free, _ = mem_get_info(self.device)
        return int(free * fraction)

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, block_size: int,
                          dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        def zeros(dim: int) -> torch.Tensor:
            return torch.zeros(num_blocks, block_size, spec.num_kv_heads, dim, dtype=dtype, device=self.device)

        if spec.value_in_key is not None:  # the value is the key's first features: no storage of its own
            keys = [zeros(spec.head_dim) for _ in range(spec.num_layers)]
            return [(key, key[..., :spec.value_in_key]) for key in keys]
        return [(zeros(spec.head_dim), zeros(spec.v_head_dim or spec.head_dim)) for _ in range(spec.num_layers)]

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = torch.tensor(copies, device=self.device).T
        for key_cache, value_cache in kv_caches:
            key_cache[dst] = key_cache[src]
            if value_cache.data_ptr() != key_cache.data_ptr():  # a value inside the key moved with it
                value_cache[dst] = value_cache[src]

    def prepare(self, batch: ForwardBatch) -> PagedAttentionMetadata:
        return kernels.paged_attention_metadata(batch)

    def paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, scale: float,
                        sliding_window: int | None = None, logit_soft_cap: float | None = None) -> torch.Tensor:
        return kernels.paged_attention(self.kernels, query, key, value, kv_cache, batch, scale, sliding_window,
                                       logit_soft_cap)

    def synchronize(self) -> None:
        if self.device.type == gcu.DEVICE_TYPE:
            torch.accelerator.synchronize(self.device)


def build(config: object = None, rank: RankInfo | None = None) -> GcuBackend:
    reason = gcu.why_not_usable()
    if reason is not None:
        raise RuntimeError(f"backend gcu cannot run here: {reason}")
    return GcuBackend(config, rank)
