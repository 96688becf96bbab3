"""The quantized KV cache's row layout every backend reads: 1-byte codes, then a float32 scale
(``layers/kv_quant.py`` holds the torch codec and its reference)."""

from __future__ import annotations

import torch

# --kv-cache-dtype names of the quantized caches and their torch storage dtype (fp8 is E4M3, as in vLLM).
QUANTIZED_KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                       "fp8_e5m2": torch.float8_e5m2}
SCALE_BYTES = 4  # the float32 scale after a row's codes


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a quantized KV cache's storage dtype."""
    return dtype in QUANTIZED_KV_DTYPES.values()


def value_in_key(key_cache: torch.Tensor, features: int) -> torch.Tensor:
    """The value cache that is a view of ``key_cache``'s last ``features`` features (``KVCacheSpec.value_in_key``);
    of a quantized cache with the row's scale after them, so that the view is itself a quantized cache."""
    scale = SCALE_BYTES if is_quantized(key_cache.dtype) else 0
    return key_cache[..., key_cache.shape[-1] - scale - features:]


def is_view_of(value_cache: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether ``value_cache`` lies inside ``key_cache``'s memory (a value in the key): its blocks move with the key's."""
    start = key_cache.data_ptr()  # not the storage: a backend may cut every layer's caches from one buffer
    return start <= value_cache.data_ptr() < start + key_cache.numel() * key_cache.element_size()
