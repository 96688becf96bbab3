"""Quantized KV caches (``cache.kv_cache_dtype`` int8, fp8 = fp8_e4m3, fp8_e5m2): the row layout (its
names in ``core/kv_layout.py``) and its torch reference, which every backend's kernels are tested against.

A quantized cache is ``[num_blocks, block_size, kv_heads, dim + 4]`` of ``torch.int8``,
``torch.float8_e4m3fn`` or ``torch.float8_e5m2``: each (token, KV head) row holds its ``dim`` 1-byte codes
followed by the 4 bytes of its float32 scale, and a feature's value is ``code * scale`` (llama.cpp's q8_0
keeps its scale beside its codes the same way). Block copies, prefix caching, preemption and tensor
parallelism (a rank holds its heads' rows) move rows and never look inside one.

Scales: fixed per layer and KV head when the checkpoint ships them (``kv_scales.py`` reads them), written into
every row; otherwise computed on write, one per (token, KV head): ``absmax / code_max``. A scale per token
costs 4 bytes a row (a 128-feature head: 132 bytes instead of 256 in float16, 1.94x the tokens) and never
clips: a scale fixed from the first prefill's absmax clips every later token that exceeds it, which a margin
only makes rarer, and one outlier token (a BOS key, a long context's later layers) then coarsens the whole head.
"""

from __future__ import annotations

import torch

from pluginfer.core.kv_layout import QUANTIZED_KV_DTYPES, SCALE_BYTES, is_quantized

# The largest code of each quantized cache dtype: a row's absmax maps to it.
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def row_width(dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a ``dtype`` cache holding ``dim`` features."""
    return dim + SCALE_BYTES if is_quantized(dtype) else dim


def feature_dim(cache: torch.Tensor) -> int:
    """Features of one row of ``cache`` (its last axis, less the scale of a quantized cache)."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache.dtype) else cache.shape[-1]


def check_head_dim(dim: int, dtype: torch.dtype) -> None:
    """ValueError unless a quantized row's scale sits 4-byte aligned (``dim`` a multiple of 4)."""
    if is_quantized(dtype) and dim % 4:
        raise ValueError(f"cache.kv_cache_dtype {dtype}: a head dimension of {dim} is no multiple of 4; "
                         "use a float KV cache dtype for this model")


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales of quantized ``rows`` ``[..., dim + 4]``, as a view ``[...]`` (writable)."""
    return rows.view(torch.uint8)[..., -SCALE_BYTES:].view(torch.float32)[..., 0]


def codes(rows: torch.Tensor) -> torch.Tensor:
    """The codes of quantized ``rows`` ``[..., dim + 4]``, a view ``[..., dim]``."""
    return rows[..., :-SCALE_BYTES]


def quantize(x: torch.Tensor, dtype: torch.dtype, fixed_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[tokens, kv_heads, dim]`` as quantized rows ``[tokens, kv_heads, dim + 4]`` of ``dtype``.

    ``fixed_scales`` ``[kv_heads]`` (a checkpoint's): every row of head ``h`` takes that scale and codes past
    the range clip; None: each row's own ``absmax / code_max`` (1 for a row of zeros). Codes round to nearest
    even from ``x / scale`` in float32.
    """
    code_max = CODE_MAX[dtype]
    x = x.float()
    if fixed_scales is None:
        absmax = x.abs().amax(-1)
        scale = torch.where(absmax > 0, absmax / code_max, torch.ones_like(absmax))
    else:
        scale = fixed_scales.float().to(x.device).expand(x.shape[:-1])
    scaled = (x / scale[..., None]).clamp(-code_max, code_max)
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=dtype, device=x.device)
    codes(out).copy_(scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype))
    scales(out).copy_(scale)
    return out


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., dim]`` values of quantized ``rows`` ``[..., dim + 4]``; other rows as float32."""
    if not is_quantized(rows.dtype):
        return rows.float()
    return codes(rows).float() * scales(rows)[..., None]


def write_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor,
               fixed_scales: torch.Tensor | None = None) -> None:
    """Quantize ``x`` ``[tokens, kv_heads, dim]`` into ``cache``'s slots ``slot_mapping`` (the reference write)."""
    rows = quantize(x, cache.dtype, fixed_scales)
    flat = cache.view(-1, *cache.shape[2:]).view(torch.uint8)  # index_copy_ has no float8 kernel
    flat.index_copy_(0, slot_mapping, rows.view(torch.uint8))


FLOAT_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_kv_cache_dtype(backend: object, spec: object, dtype: torch.dtype, name: str) -> None:
    """At start-up, before any weight loads: ValueError naming the dtype and the backend (or the model's cache)
    when ``backend`` has no attention kernel reading a ``dtype`` cache of ``spec`` (a ``KVCacheSpec``).
    A backend lists the dtypes it reads in ``kv_cache_dtypes`` (``DeviceBackend``); without it, the float ones."""
    readable = getattr(backend, "kv_cache_dtypes", FLOAT_KV_DTYPES)
    if dtype not in readable:
        names = ", ".join(sorted({dtype_name(d) for d in readable}))
        raise ValueError(f"cache.kv_cache_dtype {name}: the {backend.name} backend has no attention kernel "
                         f"reading {dtype_name(dtype)} KV caches (it reads {names})")
    if not is_quantized(dtype):
        return
    check_head_dim(spec.head_dim, dtype)
    # a value in the key (multi-head latent attention) starts that many features into the key's row
    check_head_dim(spec.value_in_key or spec.v_head_dim or spec.head_dim, dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``--kv-cache-dtype``'s name of a cache dtype (int8, fp8_e4m3, fp8_e5m2, float16, ...)."""
    names = {value: key for key, value in QUANTIZED_KV_DTYPES.items() if key != "fp8"}
    return names.get(dtype) or str(dtype).removeprefix("torch.")


class FixedScaleKVCache(tuple):
    """A layer's ``(key cache, value cache)`` whose rows take fixed scales per KV head (a checkpoint's,
    ``kv_scales.py``); it unpacks and copies as the plain pair does."""

    key_scales: torch.Tensor  # [kv_heads] float32
    value_scales: torch.Tensor

    def __new__(cls, key_cache: torch.Tensor, value_cache: torch.Tensor, key_scales: torch.Tensor,
                value_scales: torch.Tensor) -> FixedScaleKVCache:
        pair = super().__new__(cls, (key_cache, value_cache))
        pair.key_scales, pair.value_scales = key_scales, value_scales
        return pair


def fixed_scales(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The key and value scales fixed for this layer's cache, or (None, None): each row's own."""
    return getattr(kv_cache, "key_scales", None), getattr(kv_cache, "value_scales", None)
