"""The core's kernel ops (norms, activations, rotary, paged attention, MoE, dense linears) and the open
table's public calls (``core/kernel_table.py``: :func:`define_op`, :func:`implement`, :class:`KernelTable`).

Each reference function below is defined as an op with ``define_op``, the call a plugin uses for its own
ops (a quant format defines its matmul in its module, ``quant/ggml_ops.py`` for instance): the function's
name is the op's, its signature and docstring the contract, its body the oracle every device kernel is
tested against. A backend keeps a :class:`KernelTable` and registers its implementations into it (the cpu
backend in ``backends/cpu/ops.py``, the cuda backend its Triton kernels); a lookup of an op the backend did
not implement falls back to the reference. ``DeviceBackend.op(name)`` hands layers and quant methods the
backend's implementation (or None: they keep their own torch path, which equals the reference).

Conventions shared by every op: tensors live on one device; an implementation may return None
(False for the in-place rotary ops) for inputs it does not handle, and the caller then runs its
torch path. Paged caches are ``[num_blocks, block_size, kv_heads, dim]``; a value cache may be a view
of the key cache's first features (multi-head latent attention), which every op reads as it is. A quantized
cache (int8, float8) is ``[..., dim + 4]``: each row's codes and its float32 scale (``core/kv_quant.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pluginfer.core import kv_quant
from pluginfer.core.batch import ForwardBatch

# The table's public calls, re-exported: ``kernels.define_op(fn)``, ``kernels.implement(...)``, ``kernels.OPS``.
from pluginfer.core.kernel_table import OPS as OPS
from pluginfer.core.kernel_table import KernelOp as KernelOp
from pluginfer.core.kernel_table import KernelTable as KernelTable
from pluginfer.core.kernel_table import define_op as define_op
from pluginfer.core.kernel_table import implement as implement
from pluginfer.core.kernel_table import lookup as lookup
from pluginfer.core.kernel_table import withdraw as withdraw


# -- norms and activations --------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             offset: float) -> torch.Tensor | None:
    """``x / rms(x) * (weight + offset)`` over the last axis, in float32.

    ``residual`` given: it becomes ``x + residual`` in place and is what gets normalized (the fused
    residual add). Rounding follows ``layers.norm.RMSNorm``: a half-precision input without offset is
    normalized in float32, rounded, then multiplied by the weight in its own dtype.
    """
    if residual is not None:
        residual.add_(x)
        x = residual
    dtype = x.dtype
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    if dtype == torch.float32:
        return normed * (weight.float() + offset if offset else weight)
    if offset:
        return (normed * (weight.float() + offset)).to(dtype)
    return normed.to(dtype) * weight


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` where ``x`` is ``[..., 2n]`` = ``[gate | up]``; returns ``[..., n]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor | None:
    """``gelu(gate) * up`` (``approximate`` "none" or "tanh") where ``x`` is ``[..., 2n]`` = ``[gate | up]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


# -- rotary embeddings ------------------------------------------------------------------------------
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, neox: bool) -> None:
    if neox:
        half = rotary_dim // 2
        first, second = x[..., :half], x[..., half:rotary_dim]
    else:
        first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    x1, x2 = first.float().clone(), second.float().clone()  # float() of float32 is no copy
    cos, sin = cos[:, None, :], sin[:, None, :]
    first.copy_(x1 * cos - x2 * sin)
    second.copy_(x2 * cos + x1 * sin)


def rotary_neox(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary_dim: int) -> bool:
    """Rotate the first ``rotary_dim`` features of every head in place, the two halves as pairs (neox/llama).

    ``query`` ``[tokens, heads, head_dim]``, ``key`` ``[tokens, kv_heads, head_dim]`` (rows may be strided);
    ``cos``/``sin`` float32 ``[tokens, rotary_dim / 2]``. Features past ``rotary_dim`` are left alone
    (partial rotary). Computed in float32. Returns True (done).
    """
    _rotate(query, cos, sin, rotary_dim, True)
    _rotate(key, cos, sin, rotary_dim, True)
    return True


def rotary_interleaved(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary_dim: int) -> bool:
    """As :func:`rotary_neox`, adjacent features ``(2i, 2i + 1)`` as pairs (GPT-J, GLM)."""
    _rotate(query, cos, sin, rotary_dim, False)
    _rotate(key, cos, sin, rotary_dim, False)
    return True


# -- paged KV cache and attention --------------------------------------------------------------------
def write_kv(key: torch.Tensor, value: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store token ``t``'s ``key[t]`` (``[tokens, kv_heads, dim]``) at cache slot ``slot_mapping[t]``
    (``block * block_size + offset``), and its value unless ``value`` is None (a value inside the key).
    A quantized cache (``core/kv_quant.py``) gets each row's codes and its own scale."""
    if kv_quant.is_quantized(key_cache.dtype):
        kv_quant.write_rows(key_cache, slot_mapping, key)
        if value is not None:
            kv_quant.write_rows(value_cache, slot_mapping, value)
        return
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    if value is not None:
        value_cache.flatten(0, 1).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _attend_one(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor,
                scale: float, sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """float32 attention of ``[q, heads, dim]`` over one sequence's ``[n, kv_heads, dim]`` keys."""
    groups = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(groups, dim=1)
    values = values.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    key_positions = torch.arange(keys.shape[0], device=query.device)
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed = allowed & (key_positions[None, :] > query_positions[:, None] - sliding_window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first ``length`` cached rows ``[length, kv_heads, dim]`` (a quantized cache's dequantized)."""
    positions = torch.arange(length, device=cache.device)
    rows = cache[table[positions // cache.shape[1]], positions % cache.shape[1]]
    return kv_quant.dequantize(rows) if kv_quant.is_quantized(cache.dtype) else rows


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """One query token per sequence: ``query`` ``[seqs, heads, dim]`` at position ``seq_lens[i] - 1``
    attends over the sequence's ``seq_lens[i]`` cached keys (``block_tables[i]`` names its blocks).

    GQA: query head ``h`` reads KV head ``h // (heads / kv_heads)``. ``sliding_window``: only keys at
    positions ``> position - sliding_window``. ``soft_cap``: scores become ``cap * tanh(score / cap)``
    before the softmax. Returns ``[seqs, heads, v_dim]`` in the query's dtype.
    """
    starts = torch.arange(seq_lens.shape[0] + 1, device=query.device)
    return paged_prefill_attention(query, key_cache, value_cache, block_tables, starts, seq_lens, 1, scale,
                                   sliding_window, soft_cap)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            max_query_len: int, scale: float, sliding_window: int | None,
                            soft_cap: float | None) -> torch.Tensor:
    """Any number of query tokens per sequence, over the paged cache (chunked prefill, prefix-cache hits).

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i + 1]`` (at most
    ``max_query_len``): its last positions, whose keys are already in the cache. Causal within the
    sequence; GQA, sliding window and soft cap as :func:`paged_decode_attention`. Returns
    ``[tokens, heads, v_dim]`` in the query's dtype.
    """
    out = query.new_zeros(query.shape[0], query.shape[1], kv_quant.feature_dim(value_cache))
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    for i, length in enumerate(lengths):
        rows = slice(starts[i], starts[i + 1])
        count = starts[i + 1] - starts[i]
        keys = _gather(key_cache, block_tables[i], length)
        values = _gather(value_cache, block_tables[i], length)
        positions = torch.arange(length - count, length, device=query.device)
        out[rows] = _attend_one(query[rows], keys, values, positions, scale, sliding_window, soft_cap).to(out.dtype)
    return out


# -- mixture of experts -----------------------------------------------------------------------------
def _gated(x: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def fused_moe(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str) -> torch.Tensor | None:
    """Each token's router-weighted sum over its ``top_k`` experts' gated MLPs (``layers.moe.FusedExperts``).

    ``hidden`` ``[tokens, hidden]``; ``gate_up_proj`` ``[experts, 2 * inter, hidden]`` (gate rows first) and
    ``down_proj`` ``[experts, hidden, inter]`` in ``hidden``'s dtype; ``topk_weights`` float32 and
    ``topk_ids`` ``[tokens, top_k]``; ``activation`` ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``. Rounding
    follows the layer: both projections and the activation in the model dtype, the weighting and the sum
    over ``top_k`` in float32, the result rounded to the model dtype.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    outputs = torch.empty(flat_ids.shape[0], hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
    for expert in flat_ids.unique().tolist():
        pairs = (flat_ids == expert).nonzero().flatten()
        gate_up = F.linear(hidden[pairs // top_k], gate_up_proj[expert])
        outputs[pairs] = F.linear(_gated(gate_up, activation), down_proj[expert])
    weighted = outputs.float() * topk_weights.flatten()[:, None].float()
    return weighted.view(-1, top_k, hidden.shape[-1]).sum(dim=1).to(hidden.dtype)


# -- dense weights: the layout a loaded weight is kept in, and the matmul that reads it ----------------
def dense_layout(weight: torch.Tensor, batched: bool, packed_only: bool) -> str:
    """The name of the layout the backend keeps a loaded ``[out, in]`` weight in.

    ``batched``: the engine runs several sequences per step (a backend may pack for that row count).
    ``packed_only``: the caller keeps the checkpoint's layout unless the backend packs (stacked MoE
    experts). ``"checkpoint"`` (the reference's only answer) keeps ``[out, in]`` for ``F.linear``; every
    other name is the backend's own and means something only to its :func:`dense_pack` and
    :func:`dense_linear`.
    """
    return "checkpoint"


def dense_pack(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """``weight`` ``[out, in]`` in ``layout`` (a name :func:`dense_layout` gave); it replaces the weight."""
    if layout != "checkpoint":
        raise ValueError(f"dense_pack: no layout named {layout!r} here (only 'checkpoint')")
    return weight


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str,
                 out_features: int) -> torch.Tensor:
    """``x @ W^T + bias`` over any leading dims of ``x``, for a weight :func:`dense_pack` put in ``layout``;
    ``out_features`` is W's row count (a packed weight may be padded)."""
    if layout != "checkpoint":
        raise ValueError(f"dense_linear: no layout named {layout!r} here (only 'checkpoint')")
    return F.linear(x, weight, bias)


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W^T + bias`` for a bfloat16/float16 weight ``[out, in]`` (the checkpoint's layout) and ``x
    [..., in]`` of its dtype, or float32 ``x`` (a GGUF file's F16/BF16 tensor in a float32 model): products
    exact in float32, summed in float32, the result rounded once to ``x``'s dtype. None from a kernel: rows,
    dtypes or layouts it does not take (the caller runs ``F.linear``)."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# -- the built-in ops: defined through the same call a plugin uses ------------------------------------
for _reference in (rms_norm, silu_and_mul, gelu_and_mul, rotary_neox, rotary_interleaved, write_kv,
                   paged_decode_attention, paged_prefill_attention, fused_moe, dense_layout, dense_pack,
                   dense_linear, half_linear):
    define_op(_reference)


# -- a backend's paged attention through its table ---------------------------------------------------
@dataclass
class PagedAttentionMetadata:
    """One step's batch split for the attention ops: the leading one-token sequences decode, the rest prefill."""

    num_decodes: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    prefill_starts: torch.Tensor  # query_start_loc of the prefill sequences, from 0
    prefill_max_query_len: int


def paged_attention_metadata(batch: ForwardBatch) -> PagedAttentionMetadata:
    """Built once per step (``DeviceBackend.prepare``) from host integers: no device synchronisation."""
    num_decodes = next((i for i, n in enumerate(batch.query_lens) if n != 1), len(batch.query_lens))
    prefill_lens = batch.query_lens[num_decodes:]
    return PagedAttentionMetadata(num_decodes, batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc[num_decodes:] - num_decodes, max(prefill_lens, default=0))


def paged_attention(kernels: KernelTable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, scale: float,
                    sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """``DeviceBackend.paged_attention`` from the table's ``write_kv``, ``paged_decode_attention`` and
    ``paged_prefill_attention`` (``batch.attention`` is a :class:`PagedAttentionMetadata`)."""
    key_cache, value_cache = kv_cache
    meta: PagedAttentionMetadata = batch.attention
    key_scales, value_scales = kv_quant.fixed_scales(kv_cache)
    if key_scales is not None:  # a checkpoint's scales: the reference write (no op takes them)
        kv_quant.write_rows(key_cache, batch.slot_mapping, key, key_scales)
        kv_quant.write_rows(value_cache, batch.slot_mapping, value, value_scales)
    else:
        kernels.get("write_kv")(key, value, key_cache, value_cache, batch.slot_mapping)
    decodes = meta.num_decodes
    if decodes == query.shape[0]:
        return kernels.get("paged_decode_attention")(query, key_cache, value_cache, meta.block_tables,
                                                     meta.seq_lens, scale, sliding_window, soft_cap)
    out = query.new_empty(query.shape[0], query.shape[1], kv_quant.feature_dim(value_cache))
    if decodes:
        out[:decodes] = kernels.get("paged_decode_attention")(
            query[:decodes], key_cache, value_cache, meta.block_tables[:decodes], meta.seq_lens[:decodes], scale,
            sliding_window, soft_cap)
    out[decodes:] = kernels.get("paged_prefill_attention")(
        query[decodes:], key_cache, value_cache, meta.block_tables[decodes:], meta.prefill_starts,
        meta.seq_lens[decodes:], meta.prefill_max_query_len, scale, sliding_window, soft_cap)
    return out
