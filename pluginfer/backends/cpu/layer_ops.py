"""Native kernels of the layers' float ops: paged decode and prefill attention, RMSNorm, SiLU-and-mul, GELU(tanh)-and-mul
and NeoX rotary, on float32 or float16/bfloat16 tensors (``csrc/attention.c``, ``prefill_attention.c``, ``norm.c``,
``activation.c``, ``rotary.c``).
"""

from __future__ import annotations

import torch

from pluginfer.backends.cpu.library import HALF_CODES, contiguous_as, fits_f32, fits_half
from pluginfer.backends.cpu.replay import native


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """Decode attention over the paged cache; query ``[seqs, heads, dim]``. float32 caches, or float16/bfloat16
    ones: with a float32 query the result is float32 (each cached value widened exactly, the float32 kernel's
    arithmetic: a float32 model's 16-bit KV cache), with any other query the query and the result are in the
    caches' dtype (the arithmetic in float32)."""
    half = HALF_CODES.get(key_cache.dtype)
    if half is not None:
        return _paged_decode_attention_16(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                          sliding_window, soft_cap, half)
    query, block_tables, seq_lens = contiguous_as(query, torch.float32), contiguous_as(block_tables, torch.int64), contiguous_as(seq_lens, torch.int64)
    if not (fits_f32(key_cache) and fits_f32(value_cache)):
        raise ValueError("paged_decode_attention needs contiguous float32 key and value caches")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, v_dim = value_cache.shape
    out = torch.empty(num_seqs, num_heads, v_dim, dtype=torch.float32)
    status = native().paged_decode_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, v_dim, block_size,
        block_tables.shape[1], scale, sliding_window or 0, soft_cap or 0.0,
    )
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its score buffer")
    return out


def _paged_decode_attention_16(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None, soft_cap: float | None, half: int) -> torch.Tensor:
    dtype = key_cache.dtype
    io_dtype = torch.float32 if query.dtype == torch.float32 else dtype  # float32: the kv16 kernel
    query, block_tables, seq_lens = contiguous_as(query, io_dtype), contiguous_as(block_tables, torch.int64), contiguous_as(seq_lens, torch.int64)
    if value_cache.dtype != dtype or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"paged_decode_attention needs contiguous key and value caches of one dtype, got "
                         f"{key_cache.dtype} and {value_cache.dtype}")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, v_dim = value_cache.shape
    out = torch.empty(num_seqs, num_heads, v_dim, dtype=io_dtype)
    kernel = native().paged_decode_attention_kv16 if io_dtype == torch.float32 else native().paged_decode_attention_16
    status = kernel(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, v_dim, block_size,
        block_tables.shape[1], scale, sliding_window or 0, soft_cap or 0.0, half,
    )
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its score buffer")
    return out


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, sliding_window: int | None,
                            soft_cap: float | None) -> torch.Tensor | None:
    """The op ``paged_prefill_attention`` (``layers/attention_ops.py``) for a query ``[tokens, heads, dim]`` over
    float32 or float16/bfloat16 caches, read in place (``csrc/prefill_attention.c``, AVX-512): the arithmetic in
    float32 on the query and each cached value widened exactly, the result float32 (a 16-bit model rounds it
    once); ``query_start_loc`` from 0. None: use the torch path (no AVX-512 build, another dtype, dims not multiples
    of 16, value rows inside the key's)."""
    kind = 0 if key_cache.dtype == torch.float32 else HALF_CODES.get(key_cache.dtype)
    head_dim, v_dim = key_cache.shape[-1], value_cache.shape[-1]
    if (kind is None or (query.dtype != torch.float32 and query.dtype not in HALF_CODES)
            or value_cache.dtype != key_cache.dtype or head_dim % 16 or v_dim % 16
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())
            or not native().prefill_attention_supported()):
        return None
    query = query.to(torch.float32).contiguous()
    tables, starts, lens = (contiguous_as(block_tables, torch.int64), contiguous_as(query_start_loc, torch.int64),
                            contiguous_as(seq_lens, torch.int64))
    tokens, heads, _ = query.shape
    _, block_size, kv_heads, _ = value_cache.shape
    out = torch.empty(tokens, heads, v_dim, dtype=torch.float32)
    status = native().paged_prefill_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), starts.data_ptr(),
        lens.data_ptr(), out.data_ptr(), lens.shape[0], heads, kv_heads, head_dim, v_dim, block_size, tables.shape[1],
        scale, sliding_window or 0, soft_cap or 0.0, kind)
    if status != 0:
        raise MemoryError("paged_prefill_attention could not allocate its buffers")
    return out


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             offset: float) -> torch.Tensor | None:
    """Fused (residual add +) RMSNorm; updates ``residual`` in place. None: use the torch path."""
    if x.dtype != torch.float32:
        # float16/bfloat16: rounded where layers/norm.py's reference rounds
        half = fits_half(x.dtype, x, weight) if residual is None else fits_half(x.dtype, x, weight, residual)
        if half is None:
            return None
        out = torch.empty_like(x)
        native().rms_norm_16(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                           out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, offset, half)
        return out
    if not (fits_f32(x) and fits_f32(weight)) or (residual is not None and not fits_f32(residual)):
        return None
    out = torch.empty_like(x)
    native().rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                    out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, offset)
    return out


def _gated_and_mul(x: torch.Tensor, kernel: str) -> torch.Tensor | None:
    """``activation(x[:, :n]) * x[:, n:]`` by the float32 ``kernel`` of csrc/activation.c, or for float16/bfloat16
    its ``kernel_16`` (rounded where torch's ``activation(gate) * up`` rounds). None: use the torch path."""
    if x.dtype != torch.float32:
        half = fits_half(x.dtype, x)
        if half is None:
            return None
        kernel, extra = kernel + "_16", (half,)
    elif not fits_f32(x):
        return None
    else:
        extra = ()
    n = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], n)
    getattr(native(), kernel)(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], n, *extra)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(x[:, :n]) * x[:, n:]``. None: use the torch path."""
    return _gated_and_mul(x, "silu_and_mul")


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor | None:
    """``gelu(x[:, :n], approximate="tanh") * x[:, n:]`` (Gemma's activation). None: use the torch path (and
    for the exact, erf form)."""
    return _gated_and_mul(x, "gelu_tanh_and_mul") if approximate == "tanh" else None


def rotary_neox(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary_dim: int) -> bool:
    """Rotate q ``[tokens, heads, dim]`` and k in place (rows may be strided), float32 or float16/bfloat16 (in
    float32 with the float32 cos/sin, rounded once). False: use the torch path."""
    half = HALF_CODES.get(query.dtype)
    if half is not None and key.dtype == query.dtype and fits_f32(cos) and fits_f32(sin) \
            and query.stride()[1:] == (query.shape[2], 1) and key.stride()[1:] == (key.shape[2], 1):
        native().rotary_neox_16(query.data_ptr(), key.data_ptr(), cos.data_ptr(), sin.data_ptr(), query.shape[0],
                              query.shape[1], key.shape[1], query.shape[2], rotary_dim, query.stride(0),
                              key.stride(0), half)
        return True
    if not (query.dtype == key.dtype == torch.float32 and fits_f32(cos) and fits_f32(sin)
            and query.stride()[1:] == (query.shape[2], 1) and key.stride()[1:] == (key.shape[2], 1)):
        return False
    native().rotary_neox(query.data_ptr(), key.data_ptr(), cos.data_ptr(), sin.data_ptr(), query.shape[0],
                       query.shape[1], key.shape[1], query.shape[2], rotary_dim, query.stride(0), key.stride(0))
    return True
