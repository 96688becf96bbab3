"""``BaseDeviceBackend``: the ``DeviceBackend`` members every device shares, written over a ``KernelTable``.

The protocol (``core/device_backend.py``) stays the contract; this class is a convenience that satisfies it. A
subclass sets ``name`` (and ``default_collective``, ``quant_kernels_required`` where they differ), calls
``super().__init__(device)``, registers its kernels into ``self.kernels``, and overrides what its device
does differently: ``free_memory`` where torch has no ``torch.<device>.mem_get_info``, ``capture_decode``
where it replays graphs. Attention runs the table's ``write_kv`` / ``paged_decode_attention`` /
``paged_prefill_attention``: a backend without kernels of its own runs their torch references on its device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.kernels import KernelTable
from pluginfer.core.kv_layout import is_view_of, value_in_key
from pluginfer.core.protocols import KVCacheSpec
from pluginfer.layers import attention_ops
from pluginfer.layers.attention_ops import PagedAttentionMetadata
from pluginfer.layers.kv_quant import FLOAT_KV_DTYPES, row_width


class BaseDeviceBackend:
    """One device, every ``DeviceBackend`` member implemented; ``self.kernels`` holds the backend's kernels."""

    name: str = ""
    default_collective: str = "gloo"
    quant_kernels_required: bool = False
    # KV cache dtypes the table's attention kernels read (DeviceBackend.kv_cache_dtypes); a subclass whose
    # kernels read quantized caches (layers/kv_quant.py's layout) adds them.
    kv_cache_dtypes: tuple[torch.dtype, ...] = FLOAT_KV_DTYPES

    def __init__(self, device: torch.device | str) -> None:
        if not self.name:
            raise TypeError(f"{type(self).__name__}: a DeviceBackend sets its plugin name (class attribute 'name')")
        self.device = torch.device(device)
        self.kernels = KernelTable(self.name)

    def op(self, name: str) -> Callable | None:
        """The kernel registered in ``self.kernels`` for op ``name``, else None (the layer keeps its torch path)."""
        return self.kernels.implementation(name)

    def free_memory(self) -> int:
        """Bytes free on ``self.device`` now, from ``torch.<device type>.mem_get_info``; ValueError naming the
        fields to set where torch has none for this device."""
        mem_get_info = getattr(getattr(torch, self.device.type, None), "mem_get_info", None)
        if mem_get_info is None:
            raise ValueError(f"backend {self.name}: torch reports no free memory on {self.device} "
                             f"(torch.{self.device.type}.mem_get_info); set cache.kv_cache_memory (e.g. 8GiB) "
                             "or cache.num_blocks")
        free, _ = mem_get_info(self.device)
        return int(free)

    def kv_cache_budget_bytes(self, requested: int | None, fraction: float) -> int:
        """``requested``, else ``fraction`` of ``free_memory()`` (the weights are loaded by then)."""
        if requested is not None:
            return requested
        return int(self.free_memory() * fraction)

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, block_size: int,
                          dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed ``[num_blocks, block_size, kv_heads, dim]`` keys and values per layer on ``self.device``."""
        def zeros(dim: int) -> torch.Tensor:  # a quantized cache's row ends in its scale
            return torch.zeros(num_blocks, block_size, spec.num_kv_heads, row_width(dim, dtype), dtype=dtype,
                               device=self.device)

        if spec.value_in_key is not None:  # the value is the key's last features: no storage of its own
            keys = [zeros(spec.head_dim) for _ in range(spec.num_layers)]
            return [(key, value_in_key(key, spec.value_in_key)) for key in keys]
        return [(zeros(spec.head_dim), zeros(spec.v_head_dim or spec.head_dim)) for _ in range(spec.num_layers)]

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = torch.tensor(copies, device=self.device).T
        for key_cache, value_cache in kv_caches:
            key_cache[dst] = key_cache[src]
            if not is_view_of(value_cache, key_cache):  # a value inside the key moved with it
                value_cache[dst] = value_cache[src]

    def prepare(self, batch: ForwardBatch) -> PagedAttentionMetadata:
        return attention_ops.paged_attention_metadata(batch)

    def paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, scale: float,
                        sliding_window: int | None = None, logit_soft_cap: float | None = None) -> torch.Tensor:
        return attention_ops.paged_attention(self.kernels, query, key, value, kv_cache, batch, scale, sliding_window,
                                       logit_soft_cap)

    def synchronize(self) -> None:
        """Wait for the device's queued work; nothing to wait for on the host (or a CPU stand-in device)."""
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is not None and self.device.type == accelerator.type:
            torch.accelerator.synchronize(self.device)

    def capture_decode(self, forward: Any, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        """No replays (``DeviceBackend.capture_decode``): every step runs eagerly."""
        return None
