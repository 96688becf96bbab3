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
