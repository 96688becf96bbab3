"""The CPU backend: torch ops, paged KV cache in host memory.

Attention gathers each sequence's keys from its blocks and runs one batched
scaled-dot-product attention for the decode rows and one for the prefill rows; masks and
gather indices are built once per step in ``prepare`` and shared by every layer.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import build as native_build
from pluginfer.backends.cpu import kv_quant as native_kv
from pluginfer.backends.cpu import layer_ops, library, ops
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.backends.cpu.step_replay import CpuDecodeReplay
from pluginfer.core.batch import ForwardBatch
from pluginfer.core.config import EngineConfig
from pluginfer.core.device_backend import DecodeForward
from pluginfer.core.kernels import KernelTable
from pluginfer.core.kv_layout import is_view_of, value_in_key
from pluginfer.core.protocols import KVCacheSpec, RankInfo
from pluginfer.layers import kv_quant
from pluginfer.layers.kv_quant import FLOAT_KV_DTYPES, QUANTIZED_KV_DTYPES, row_width

logger = logging.getLogger(__name__)

# The KV cache's size when cache.kv_cache_memory is not given (vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE=4).
DEFAULT_KV_CACHE_BYTES = 4 * 2**30
# KV cache dtypes the native decode attention reads (the query and its result then in the cache's dtype).
NATIVE_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@cache
def _report_unavailable(reason: str) -> None:
    """Once per process: a warning saying how to get the kernels, or a note when PLUGINFER_NATIVE=0 chose this."""
    if os.environ.get("PLUGINFER_NATIVE") == "0":
        logger.info("cpu backend: native kernels off (PLUGINFER_NATIVE=0); using the torch path")
    else:
        logger.warning("cpu backend: native kernels unavailable (%s); using the slower torch path. To get them: %s",
                       reason, ops.HOW_TO_GET)


@dataclass
class _Part:
    """Rows of the batch that share one padded attention call (the decodes, or the prefills)."""

    # [seqs, max_q] flat token index per padded query, None if contiguous decode
    token_rows: torch.Tensor | None
    query_valid: torch.Tensor | None  # [seqs, max_q] bool
    key_slots: torch.Tensor  # [seqs, max_keys] cache slot per key
    query_positions: torch.Tensor  # [seqs, max_q]
    key_positions: torch.Tensor  # [max_keys]
    key_valid: torch.Tensor  # [seqs, 1, 1 or max_q, max_keys] bool
    token_start: int
    token_end: int
    masks: dict = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor | None:
        if sliding_window not in self.masks:
            allowed = self.key_valid
            if sliding_window is not None:
                recent = self.key_positions[None, None, :] > self.query_positions[:, :, None] - sliding_window
                allowed = allowed & recent.unsqueeze(1)
            self.masks[sliding_window] = None if bool(allowed.all()) else allowed
        return self.masks[sliding_window]


def _part(batch: ForwardBatch, seqs: slice, block_size: int) -> _Part | None:
    seq_lens = batch.seq_lens[seqs]
    if seq_lens.numel() == 0:
        return None
    starts = batch.query_start_loc[seqs]
    query_lens = batch.query_start_loc[seqs.start + 1: seqs.stop + 1] - starts
    max_keys = int(seq_lens.max())
    max_q = int(query_lens.max())
    key_positions = torch.arange(max_keys)
    tables = batch.block_tables[seqs, : -(-max_keys // block_size)]
    key_slots = (tables[:, key_positions // block_size] * block_size + key_positions % block_size)
    offsets = torch.arange(max_q)
    query_valid = offsets[None, :] < query_lens[:, None]
    query_positions = (seq_lens - query_lens)[:, None] + offsets[None, :]
    # Causal within the sequence; padded query rows see valid slots too (their output is dropped).
    key_valid = (key_positions[None, None, :] <= query_positions[:, :, None]).unsqueeze(1)
    token_start, token_end = int(starts[0]), int(batch.query_start_loc[seqs.stop])
    token_rows = None
    if max_q > 1:
        token_rows = (starts[:, None] + offsets[None, :]).masked_fill(~query_valid, token_start)
    return _Part(token_rows, query_valid if max_q > 1 else None, key_slots, query_positions, key_positions,
                 key_valid, token_start, token_end)


@dataclass
class CpuAttentionMetadata:
    # None when there are no decode rows or the native kernel serves them
    decode: _Part | None
    # None when there are no prefill rows or the native kernel serves them (built on first use otherwise)
    prefill: _Part | None
    num_native_decodes: int = 0  # leading decode rows for the native kernel
    # Their block tables and key counts, int64 and contiguous, sliced once per step for every layer.
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    # The prefill rows' (after the decodes): their sequences' block tables, key counts and query_start_loc from 0,
    # int64 and contiguous (None without the native kernels or prefill rows).
    prefill_block_tables: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_starts: torch.Tensor | None = None
    num_decodes: int = 0


THREADS_ENV = "PLUGINFER_CPU_THREADS"


def environment_threads() -> int | None:
    """``PLUGINFER_CPU_THREADS`` as a thread count (None when unset or empty); ValueError naming it otherwise."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV}={value!r}: expected a positive number of threads (or use --threads)")
    return int(value)


class CpuBackend:
    """Runs everything with torch on the host."""

    name = "cpu"
    device = torch.device("cpu")
    default_collective = "gloo"
    quant_kernels_required = False  # formats without a kernel here take their torch path
    # Quantized caches: csrc/kv_quant_attention.c, or dequantize-then-attend in torch without the library.
    kv_cache_dtypes = (*FLOAT_KV_DTYPES, *QUANTIZED_KV_DTYPES.values())

    def __init__(self, config: EngineConfig | None = None, rank: RankInfo | None = None,
                 native_kernels: bool = True) -> None:
        """``native_kernels`` False: the torch path only, nothing compiled or probed (the metal backend's use)."""
        if native_kernels:
            # a bad PLUGINFER_CPU_ISA or PLUGINFER_AMX is an error naming it, before any build
            native_build.isa()
            library.amx_enabled()
        # GGUF linears' activations: the config's, else PLUGINFER_QUANT_ACTIVATIONS (a bad value fails here)
        native_quant.configure_quant_activations(config.quant_activations if config is not None else None)
        native_quant.quant_activations()
        threads = config.threads if config is not None and config.threads else environment_threads()
        if threads:
            torch.set_num_threads(threads)
        elif rank is not None and rank.local_world_size > 1:  # ranks on one machine share its cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // rank.local_world_size))
        self.rank = rank or RankInfo()
        reason = ops.available() if native_kernels else "not asked for"
        self.native_kernels = reason is None
        if reason is not None and native_kernels:
            _report_unavailable(reason)
        # The weight-layout policy (native panels, oneDNN, MKL's transposed GEMV) enters through the table.
        self.kernels = KernelTable(self.name)
        ops.register(self.kernels, self)

    def capture_decode(self, forward: Callable, max_num_seqs: int, max_blocks_per_seq: int,
                       block_size: int) -> CpuDecodeReplay | None:
        """Decode steps recorded once per batch size and replayed in one native call
        (``DeviceBackend.capture_decode``, ``step_replay.py``); None without the native kernels, and under
        tensor parallelism (a collective's all-reduce is no native call a program could hold). A batch size's
        first step runs eagerly, its second is recorded: a recording costs about two eager steps, and the
        first token of a process would wait for it."""
        if not self.native_kernels or self.rank.tp_size > 1:
            return None
        if isinstance(forward, DecodeForward):  # the LM head recorded after the layers where it can be
            return CpuDecodeReplay(forward.forward, max_num_seqs, max_blocks_per_seq, block_size, eager_steps=1,
                                   head=forward.compute_logits)
        return CpuDecodeReplay(forward, max_num_seqs, max_blocks_per_seq, block_size, eager_steps=1)

    def op(self, name: str) -> Callable | None:
        """The table's cpu kernel for op ``name`` (``ops.py`` registered them), or None (the layer keeps its
        torch reference)."""
        return self.kernels.implementation(name)

    def kv_cache_budget_bytes(self, requested: int | None, fraction: float) -> int:
        """``requested``, else a fixed default (as vLLM's CPU backend: 4 GiB), never more than ``fraction``
        of the memory available now. The worker then caps it at what ``max_num_seqs`` sequences of
        ``max_model_len`` tokens can use, so a small model's cache is sized for the job."""
        if requested is not None:
            return requested
        return min(DEFAULT_KV_CACHE_BYTES, int(_available_memory() * fraction))

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, block_size: int,
                          dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values in one anonymous memory map: zeros that cost nothing up front
        (the OS hands out zeroed pages when first written), where ``torch.zeros`` would write every page
        before the first request. Slots a step has not written read as zeros, as before."""
        v_dim = row_width(spec.v_head_dim or spec.head_dim, dtype)  # a quantized row ends in its scale
        key_shape = (num_blocks, block_size, spec.num_kv_heads, row_width(spec.head_dim, dtype))
        value_shape = None if spec.value_in_key is not None else (num_blocks, block_size, spec.num_kv_heads, v_dim)
        shapes = [shape for _ in range(spec.num_layers) for shape in (key_shape, value_shape) if shape is not None]
        tensors = iter(_lazy_zeros(shapes, dtype))
        if spec.value_in_key is not None:
            # the value is the key's last features: no storage of its own
            keys = [next(tensors) for _ in range(spec.num_layers)]
            return [(key, value_in_key(key, spec.value_in_key)) for key in keys]
        return [(next(tensors), next(tensors)) for _ in range(spec.num_layers)]

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = torch.tensor(copies).T
        for key_cache, value_cache in kv_caches:
            key_cache[dst] = key_cache[src]
            if not is_view_of(value_cache, key_cache):  # a value inside the key moved with it
                value_cache[dst] = value_cache[src]

    def prepare(self, batch: ForwardBatch) -> CpuAttentionMetadata:
        query_lens = batch.query_lens
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        if not self.native_kernels:
            return CpuAttentionMetadata(_part(batch, slice(0, num_decodes), batch.block_size),
                                        _part(batch, slice(num_decodes, len(query_lens)), batch.block_size),
                                        num_decodes=num_decodes)
        meta = CpuAttentionMetadata(None, None, num_decodes=num_decodes)
        if num_decodes:
            meta.num_native_decodes = num_decodes
            meta.decode_block_tables = batch.block_tables[:num_decodes].to(torch.int64).contiguous()
            meta.decode_seq_lens = batch.seq_lens[:num_decodes].to(torch.int64).contiguous()
        if num_decodes < len(query_lens):
            meta.prefill_block_tables = batch.block_tables[num_decodes:].to(torch.int64).contiguous()
            meta.prefill_seq_lens = batch.seq_lens[num_decodes:].to(torch.int64).contiguous()
            meta.prefill_starts = (batch.query_start_loc[num_decodes:] - batch.query_start_loc[num_decodes]).to(
                torch.int64).contiguous()
        return meta

    def paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, scale: float,
                        sliding_window: int | None = None, logit_soft_cap: float | None = None) -> torch.Tensor:
        """``value`` None: the value cache is a view of the key cache (MLA's latent), only keys are written."""
        key_cache, value_cache = kv_cache
        if kv_quant.is_quantized(key_cache.dtype):
            return self._quantized_attention(query, key, value, kv_cache, batch, scale, sliding_window,
                                             logit_soft_cap)
        flat_keys = key_cache.view(-1, *key_cache.shape[2:])
        flat_values = value_cache.view(-1, *value_cache.shape[2:])
        # Another dtype (a float32 model's 16-bit cache): rows made contiguous first, so that a recorded step
        # notes the rounding as one from_f32 entry (step_replay.py); the same rounding as torch's copy_.
        flat_keys.index_copy_(0, batch.slot_mapping,
                              key if key.dtype == flat_keys.dtype else key.contiguous().to(flat_keys.dtype))
        if value is not None:
            flat_values.index_copy_(0, batch.slot_mapping, value if value.dtype == flat_values.dtype
                                    else value.contiguous().to(flat_values.dtype))
        meta: CpuAttentionMetadata = batch.attention
        decodes = meta.num_native_decodes
        # The C kernel reads contiguous value rows; a value inside the key takes the torch path.
        # A float32 query against a 16-bit cache (a float32 model's kv_cache_dtype) stays float32: the kernel
        # widens the cached values, the query is not rounded. A 16-bit query takes a cache of its own dtype.
        if decodes and torch.float32 not in (query.dtype, key_cache.dtype) and query.dtype != key_cache.dtype:
            # the other 16-bit dtype (a bfloat16 model's float16 cache): the query widened to float32 (exactly) takes
            # the kernel that widens the cached rows, as a float32 model's does, not the torch path
            if decodes == query.shape[0] and key_cache.dtype in NATIVE_CACHE_DTYPES and value_cache.is_contiguous():
                return layer_ops.paged_decode_attention(query.float(), key_cache, value_cache,
                                                        meta.decode_block_tables, meta.decode_seq_lens, scale,
                                                        sliding_window, logit_soft_cap).to(query.dtype)
        native_decodes = decodes and key_cache.dtype in NATIVE_CACHE_DTYPES and value_cache.is_contiguous() \
            and (key_cache.dtype == torch.float32 or query.dtype in (key_cache.dtype, torch.float32))
        if native_decodes and decodes == query.shape[0] and query.dtype in (key_cache.dtype, torch.float32):
            # Every row decodes (the steady state): the kernel's output (in the query's dtype) is the result.
            return layer_ops.paged_decode_attention(query, key_cache, value_cache, meta.decode_block_tables,
                                                           meta.decode_seq_lens, scale, sliding_window,
                                                           logit_soft_cap)
        out = query.new_empty(query.shape[0], query.shape[1], value_cache.shape[-1])
        if native_decodes:
            decode_query = query[:decodes] if query.dtype == torch.float32 else query[:decodes].to(key_cache.dtype)
            out[:decodes] = layer_ops.paged_decode_attention(
                decode_query, key_cache, value_cache, meta.decode_block_tables,
                meta.decode_seq_lens, scale, sliding_window, logit_soft_cap).to(out.dtype)
        elif decodes:
            # the kernel takes float32, float16, bfloat16 caches; others take the torch path
            _attend(_decode_part(batch, meta), query, flat_keys, flat_values, out, scale, sliding_window,
                    logit_soft_cap)
        if not decodes and meta.decode is not None:
            _attend(meta.decode, query, flat_keys, flat_values, out, scale, sliding_window, logit_soft_cap)
        if meta.num_decodes < query.shape[0]:
            self._prefill_attention(query, key_cache, value_cache, flat_keys, flat_values, out, batch, scale,
                                    sliding_window, logit_soft_cap)
        return out

    def _prefill_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           flat_keys: torch.Tensor, flat_values: torch.Tensor, out: torch.Tensor, batch: ForwardBatch,
                           scale: float, sliding_window: int | None, logit_soft_cap: float | None) -> None:
        """``out``'s prefill rows (those after the decodes): the native kernel over the paged cache where it takes
        them (``layer_ops.paged_prefill_attention``), else SDPA on the gathered rows."""
        meta: CpuAttentionMetadata = batch.attention
        start = meta.num_decodes
        if meta.prefill_block_tables is not None:
            result = layer_ops.paged_prefill_attention(query[start:], key_cache, value_cache,
                                                       meta.prefill_block_tables, meta.prefill_starts,
                                                       meta.prefill_seq_lens, scale, sliding_window, logit_soft_cap)
            if result is not None:
                out[start:] = result.to(out.dtype)
                return
        if meta.prefill is None:
            meta.prefill = _part(batch, slice(start, len(batch.query_lens)), batch.block_size)
        _attend(meta.prefill, query, flat_keys, flat_values, out, scale, sliding_window, logit_soft_cap)

    def _quantized_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, scale: float,
                             sliding_window: int | None, logit_soft_cap: float | None) -> torch.Tensor:
        """A quantized cache (``layers/kv_quant.py``): the native write and one native attention call over every
        row of the step; without the library, the reference write and the torch path on dequantized rows."""
        key_cache, value_cache = kv_cache
        key_scales, value_scales = kv_quant.fixed_scales(kv_cache)
        if self.native_kernels:
            native_kv.write(key_cache, batch.slot_mapping, key, key_scales)
            if value is not None:  # None: the value is the key's last features (value_in_key), written with it
                native_kv.write(value_cache, batch.slot_mapping, value, value_scales)
            return native_kv.paged_attention(query, key_cache, value_cache, batch.block_tables,
                                             batch.query_start_loc, batch.seq_lens, scale, sliding_window,
                                             logit_soft_cap)
        kv_quant.write_rows(key_cache, batch.slot_mapping, key, key_scales)
        if value is not None:
            kv_quant.write_rows(value_cache, batch.slot_mapping, value, value_scales)
        out = query.new_empty(query.shape[0], query.shape[1], kv_quant.feature_dim(value_cache))
        flat_keys, flat_values = (cache.view(-1, *cache.shape[2:]) for cache in kv_cache)
        for part in (batch.attention.decode, batch.attention.prefill):
            if part is not None:
                _attend(part, query, flat_keys, flat_values, out, scale, sliding_window, logit_soft_cap)
        return out

    def synchronize(self) -> None:
        pass


def _decode_part(batch: ForwardBatch, meta: CpuAttentionMetadata) -> _Part:
    if meta.decode is None:
        meta.decode = _part(batch, slice(0, meta.num_native_decodes), batch.block_size)
    return meta.decode


def _attend(part: _Part, query: torch.Tensor, flat_keys: torch.Tensor, flat_values: torch.Tensor,
            out: torch.Tensor, scale: float, sliding_window: int | None, logit_soft_cap: float | None) -> None:
    seqs, max_keys = part.key_slots.shape
    # index_select copies whole rows: faster than advanced indexing
    slots = part.key_slots.view(-1)
    gather = _gather_dequantized if kv_quant.is_quantized(flat_keys.dtype) else torch.index_select
    keys = gather(flat_keys, 0, slots)
    keys = keys.view(seqs, max_keys, *keys.shape[1:]).transpose(1, 2)
    if is_view_of(flat_values, flat_keys):  # the value is the key's last features: gathered already
        values = keys[..., keys.shape[-1] - kv_quant.feature_dim(flat_values):]
    else:
        values = gather(flat_values, 0, slots)
        values = values.view(seqs, max_keys, *values.shape[1:]).transpose(1, 2)
    if part.token_rows is None:
        queries = query[part.token_start:part.token_end].unsqueeze(2)  # [seqs, heads, 1, dim]
    else:
        queries = query[part.token_rows].transpose(1, 2)  # [seqs, heads, max_q, dim]
    # a float32 query against a 16-bit cache widens the gathered rows, as the native kernels do: never rounded
    dtype = torch.promote_types(queries.dtype, keys.dtype)
    queries, keys, values = queries.to(dtype), keys.to(dtype), values.to(dtype)
    mask = part.mask(sliding_window)
    seqs, heads, max_q, _ = queries.shape
    if logit_soft_cap is None and keys.shape[1] == 1 and heads > 1:
        # One KV head (latent attention): heads become query rows of one attention. On the CPU, SDPA's
        # enable_gqa path runs tens of times slower than this for MLA's shapes.
        folded = queries.reshape(seqs, 1, heads * max_q, queries.shape[-1])
        if mask is not None and mask.shape[2] > 1:
            mask = mask.repeat(1, 1, heads, 1)  # rows ordered (head, query)
        result = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
        result = result.view(seqs, heads, max_q, -1)
    elif logit_soft_cap is None:
        result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale,
                                                enable_gqa=queries.shape[1] != keys.shape[1])
    else:
        result = _soft_capped_attention(queries, keys, values, mask, scale, logit_soft_cap)
    result = result.transpose(1, 2)  # [seqs, max_q, heads, dim]
    if part.token_rows is None:
        out[part.token_start:part.token_end] = result[:, 0].to(out.dtype)
    else:
        out[part.token_start:part.token_end] = result[part.query_valid].to(out.dtype)


def _gather_dequantized(cache: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of a quantized cache, dequantized to float32 (the torch path of a quantized cache)."""
    return kv_quant.dequantize(cache.view(torch.uint8).index_select(dim, index).view(cache.dtype))


def _soft_capped_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           mask: torch.Tensor | None, scale: float, cap: float) -> torch.Tensor:
    """Gemma-2 style ``cap * tanh(scores / cap)`` before the softmax (SDPA has no hook for it)."""
    groups = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * scale
    scores = cap * torch.tanh(scores / cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(values.dtype), values)


def _lazy_zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero tensors of these shapes, views of one anonymous map (64-byte aligned each), pages untouched.

    Under another default device (the metal backend allocates through this class) they are plain zeros."""
    if torch.get_default_device().type != "cpu":
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(shape) * itemsize for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // 64) * 64
    buffer = torch.frombuffer(mmap.mmap(-1, max(total, 1)), dtype=torch.uint8)  # keeps the map alive
    return [buffer[offset:offset + size].view(dtype).view(shape)
            for offset, size, shape in zip(offsets, sizes, shapes)]


def _available_memory() -> int:
    """Bytes the host can give without swapping (Linux, macOS, Windows alike)."""
    import psutil

    return int(psutil.virtual_memory().available)


def build(config: object = None, rank: RankInfo | None = None) -> CpuBackend:
    return CpuBackend(config, rank)
