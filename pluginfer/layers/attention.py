"""Paged attention layer: projections live in the model, the kernel in the device backend."""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.layers.context import current_context


class Attention(nn.Module):
    """Attends ``[tokens, heads, head_dim]`` queries over this layer's paged KV cache.

    ``kv_cache`` is bound by the pipeline's ``bind_kv_caches`` after the worker allocates the cache.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logit_soft_cap: float | None = None) -> None:
        super().__init__()
        self.backend = current_context().backend
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.sliding_window, self.logit_soft_cap = scale, sliding_window, logit_soft_cap
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, batch: ForwardBatch, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor | None) -> torch.Tensor:
        """``value`` None: the value is read from the cached key (``KVCacheSpec.value_in_key``)."""
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not bound; the worker binds it after allocating the cache")
        out = self.backend.paged_attention(
            query, key, value, self.kv_cache, batch, self.scale,
            sliding_window=self.sliding_window, logit_soft_cap=self.logit_soft_cap,
        )
        return out.reshape(query.shape[0], -1)


def bind_kv_caches(module: nn.Module | list[nn.Module], kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Hand the ``Attention`` layers inside ``module`` (in module order) one cache each."""
    modules = module if isinstance(module, list) else [module]
    layers = [m for part in modules for m in part.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise ValueError(f"the pipeline has {len(layers)} attention layers but {len(kv_caches)} KV caches")
    for layer, cache in zip(layers, kv_caches):
        layer.kv_cache = cache
