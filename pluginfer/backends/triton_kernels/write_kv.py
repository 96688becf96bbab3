"""This step's keys and values into their paged-cache slots (op ``write_kv``): one program per (token, head).
A quantized cache (``kv_codes.py``) gets each row's codes and its scale, ``absmax / code max``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.backends.triton_kernels import kv_codes


@triton.jit
def _write_kernel(src_ptr, cache_ptr, scale_ptr, slot_ptr, stride_st, stride_sh, stride_sd,
                  stride_cb, stride_co, stride_ch, stride_cd, stride_xb, stride_xo, stride_xh, block_size, dim,
                  code_max, KIND: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < dim
    row = tl.load(src_ptr + token * stride_st + head * stride_sh + d * stride_sd, mask=mask)
    block, offset = slot // block_size, slot % block_size
    target = cache_ptr + block * stride_cb + offset * stride_co + head * stride_ch
    if KIND == 0:
        tl.store(target + d * stride_cd, row.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        x = row.to(tl.float32)
        absmax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
        scale = tl.where(absmax > 0, absmax / code_max, 1.0)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -code_max), code_max)  # x / scale rounded as in C
        tl.store(target + d * stride_cd, kv_codes.encode(y, KIND), mask=mask)
        tl.store(scale_ptr + block * stride_xb + offset * stride_xo + head * stride_xh, scale)


def _write(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    tokens, heads, dim = src.shape
    if tokens == 0:
        return
    data, scales, _ = kv_codes.views(cache)
    kind = kv_codes.kind(cache)
    _write_kernel[(tokens, heads)](src, data, scales, slot_mapping, *src.stride(), *data.stride(),
                                   *kv_codes.scale_strides(scales), cache.shape[1], dim,
                                   kv_codes.CODE_MAX.get(kind, 0.0), KIND=kind, BLOCK=triton.next_power_of_2(dim))


def write_kv(key: torch.Tensor, value: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    _write(key, key_cache, slot_mapping)
    if value is not None:
        _write(value, value_cache, slot_mapping)
