"""This step's keys and values into their paged-cache slots (op ``write_kv``): one program per (token, head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kernel(src_ptr, cache_ptr, slot_ptr, stride_st, stride_sh, stride_sd,
                  stride_cb, stride_co, stride_ch, stride_cd, block_size, dim, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < dim
    row = tl.load(src_ptr + token * stride_st + head * stride_sh + d * stride_sd, mask=mask)
    target = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_co + head * stride_ch
    tl.store(target + d * stride_cd, row.to(cache_ptr.dtype.element_ty), mask=mask)


def _write(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    tokens, heads, dim = src.shape
    if tokens == 0:
        return
    _write_kernel[(tokens, heads)](src, cache, slot_mapping, *src.stride(), *cache.stride(), cache.shape[1], dim,
                                   BLOCK=triton.next_power_of_2(dim))


def write_kv(key: torch.Tensor, value: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    _write(key, key_cache, slot_mapping)
    if value is not None:
        _write(value, value_cache, slot_mapping)
