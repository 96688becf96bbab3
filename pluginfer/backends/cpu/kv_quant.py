"""Native kernels of quantized KV caches (``csrc/kv_quant_attention.c``; the layout is ``layers/kv_quant.py``'s):
the write that quantizes this step's keys and values, and paged attention over the codes for every row of a
step, decodes and prefills in one call.
"""

from __future__ import annotations

import torch

from pluginfer.backends.cpu.library import contiguous_as
from pluginfer.backends.cpu.replay import native
from pluginfer.layers import kv_quant

# The C kernels' code for each quantized cache dtype.
KINDS = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def write(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor,
          fixed_scales: torch.Tensor | None = None) -> None:
    """Quantize ``x`` ``[tokens, kv_heads, dim]`` into ``cache``'s slots (``kv_quant.write_rows``'s result)."""
    tokens, heads, dim = x.shape
    if tokens == 0:
        return
    # a 16-bit x made contiguous before it is widened: a recorded step notes copy_rows then to_f32 (step_replay.py)
    x = x if x.dtype == torch.float32 else x.contiguous().float()
    if x.stride()[1:] != (dim, 1):
        x = x.contiguous()
    slots = contiguous_as(slot_mapping, torch.int64)
    fixed = None if fixed_scales is None else contiguous_as(fixed_scales, torch.float32)
    if not cache.is_contiguous() or cache.shape[2:] != (heads, dim + kv_quant.SCALE_BYTES):
        raise ValueError(f"kv_quantize_rows: a contiguous cache of rows [{heads}, {dim + kv_quant.SCALE_BYTES}], "
                         f"got {tuple(cache.shape)}")
    native().kv_quantize_rows(x.data_ptr(), tokens, heads, dim, x.stride(0), slots.data_ptr(),
                            fixed.data_ptr() if fixed is not None else None, cache.data_ptr(), KINDS[cache.dtype])


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """``layers.attention_ops.paged_prefill_attention`` over quantized caches for any mix of decode and prefill rows:
    query ``[tokens, heads, dim]`` (float32 inside; the result in the query's dtype)."""
    _, block_size, kv_heads, value_width = value_cache.shape
    v_row = value_cache.stride(2)  # a value inside the key (value_in_key): a key row apart
    rows_apart = value_cache.stride() == (block_size * kv_heads * v_row, kv_heads * v_row, v_row, 1)
    if key_cache.dtype != value_cache.dtype or not key_cache.is_contiguous() or not rows_apart:
        raise ValueError(f"paged_attention_quantized needs a contiguous key cache and value rows of one stride, of "
                         f"one dtype, got {key_cache.dtype} and {value_cache.dtype} {tuple(value_cache.stride())}")
    tokens, heads, head_dim = query.shape
    v_dim = value_width - kv_quant.SCALE_BYTES
    q = contiguous_as(query if query.dtype == torch.float32 else query.contiguous(), torch.float32)
    tables, starts, lens = (contiguous_as(block_tables, torch.int64), contiguous_as(query_start_loc, torch.int64),
                            contiguous_as(seq_lens, torch.int64))
    out = torch.empty(tokens, heads, v_dim, dtype=torch.float32)
    status = native().paged_attention_quantized(
        q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), starts.data_ptr(),
        lens.data_ptr(), out.data_ptr(), lens.shape[0], heads, kv_heads, head_dim, v_dim, v_row, block_size,
        tables.shape[1], scale, sliding_window or 0, soft_cap or 0.0, KINDS[key_cache.dtype])
    if status != 0:
        raise MemoryError("paged_attention_quantized could not allocate its score buffer")
    return out if query.dtype == torch.float32 else out.to(query.dtype)
