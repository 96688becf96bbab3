"""Conformance kit: what every ``DeviceBackend`` owes the engine, checked on small tensors.

``check_backend(backend)`` (an instance or a no-argument factory) raises AssertionError on the first broken
promise of the protocol, naming the member: the attributes, the KV cache's budget and allocation (shape, dtype,
device, bytes per block), ``prepare`` + ``paged_attention`` against the kernel table's torch references on a
paged batch (and for each quantized dtype in ``kv_cache_dtypes``), ``copy_blocks``, ``op`` and
``capture_decode``. A third-party backend calls it from its own tests; docs/plugins.md lists every check.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pluginfer.core import kernels
from pluginfer.core.batch import ForwardBatch
from pluginfer.core.device_backend import DecodeForward, DeviceBackend
from pluginfer.core.kv_layout import value_in_key
from pluginfer.core.protocols import KVCacheSpec
from pluginfer.layers import attention_ops, kv_quant
from pluginfer.layers import ops as layer_ops  # noqa: F401 - defines the ops a backend claims

# Four sequences over 16 blocks of 4 slots, blocks shuffled: two decodes, a chunked prefill of 6 tokens after
# 8 cached ones, and a whole prompt of 8 (decodes first, as the engine orders a step).
BLOCK_SIZE, NUM_BLOCKS = 4, 16
TABLES = [[3, 1], [7, 2, 9], [0, 4, 5, 6], [10, 11]]
SEQ_LENS, QUERY_LENS = [6, 9, 14, 8], [1, 1, 6, 8]
NOT_AN_OP = "no_backend_has_this_op"


def check_backend(backend: DeviceBackend | Callable[[], DeviceBackend], ops: Iterable[str] = (),
                  dtypes: Iterable[torch.dtype] = (torch.float32,), atol: float | None = None,
                  check_capture: bool = True) -> DeviceBackend:
    """Check ``backend`` (or ``backend()``) against the ``DeviceBackend`` protocol; returns the instance.

    ``ops``: the kernel-table ops the backend claims to implement (each must come back from ``op`` as a
    callable with the reference's parameters). ``dtypes``: KV cache and attention dtypes to try.
    ``atol``: attention tolerance (default 1e-4 for float32, 2e-2 for 16-bit types). ``check_capture``:
    run ``capture_decode``'s check (it runs a toy decode model a few steps).
    """
    if isinstance(backend, type | functools.partial) or inspect.isroutine(backend):
        backend = backend()
    _check_attributes(backend)
    _check_budget(backend)
    for dtype in dtypes:
        _check_allocation(backend, dtype)
        tolerance = atol if atol is not None else (1e-4 if dtype == torch.float32 else 2e-2)
        for case in ("gqa", "window_soft_cap", "latent", "decode_only"):
            _check_attention(backend, dtype, case, tolerance)
        _check_copy_blocks(backend, dtype)
    for dtype in getattr(backend, "kv_cache_dtypes", ()):
        if kv_quant.is_quantized(dtype):
            _check_quantized_attention(backend, dtype, atol if atol is not None else 1e-4)
    _check_ops(backend, ops)
    if check_capture:
        _check_capture_decode(backend, atol if atol is not None else 1e-4)
    return backend


def _fail(member: str, message: str) -> AssertionError:
    return AssertionError(f"DeviceBackend.{member}: {message}")


def _check_attributes(backend: Any) -> None:
    if not isinstance(backend, DeviceBackend):
        missing = [name for name in ("name", "device", "default_collective", "quant_kernels_required",
                                     "kv_cache_budget_bytes", "allocate_kv_cache", "prepare", "paged_attention",
                                     "copy_blocks", "synchronize", "op", "capture_decode")
                   if not hasattr(backend, name)]
        raise _fail(missing[0] if missing else "?", f"{type(backend).__name__} does not have it")
    if not isinstance(backend.name, str) or not backend.name:
        raise _fail("name", f"a non-empty str, got {backend.name!r}")
    if not isinstance(backend.device, torch.device):
        raise _fail("device", f"a torch.device, got {type(backend.device).__name__}")
    if not isinstance(backend.default_collective, str) or not backend.default_collective:
        raise _fail("default_collective", f"a collective plugin's name, got {backend.default_collective!r}")
    if not isinstance(backend.quant_kernels_required, bool):
        raise _fail("quant_kernels_required", f"a bool, got {backend.quant_kernels_required!r}")


def _check_budget(backend: DeviceBackend) -> None:
    got = backend.kv_cache_budget_bytes(12345, 0.5)
    if got != 12345:
        raise _fail("kv_cache_budget_bytes", f"a requested budget of 12345 bytes came back as {got!r}")
    try:
        free = backend.kv_cache_budget_bytes(None, 0.5)
    except ValueError:
        return  # no memory probe here: the error names what to set instead
    if not isinstance(free, int) or free < 0:
        raise _fail("kv_cache_budget_bytes", f"without a request: a byte count (int >= 0), got {free!r}")


def _check_allocation(backend: DeviceBackend, dtype: torch.dtype) -> None:
    member = "allocate_kv_cache"
    for spec in (KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16),
                 KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, v_head_dim=8),
                 KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=24, value_in_key=16)):
        caches = backend.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, dtype)
        if not isinstance(caches, list) or len(caches) != spec.num_layers:
            raise _fail(member, f"{spec}: one (key, value) pair per layer, {spec.num_layers}, got "
                        f"{len(caches) if isinstance(caches, list) else type(caches).__name__}")
        v_dim = spec.value_in_key or spec.v_head_dim or spec.head_dim
        for layer, (key, value) in enumerate(caches):
            for what, tensor, dim in (("key", key, spec.head_dim), ("value", value, v_dim)):
                where = f"{spec}, layer {layer} {what}"
                if tensor.dim() != 4 or tensor.shape[0] < NUM_BLOCKS or \
                        tuple(tensor.shape[1:]) != (BLOCK_SIZE, spec.num_kv_heads, dim):
                    raise _fail(member, f"{where}: shape {tuple(tensor.shape)}, expected "
                                f"[>= {NUM_BLOCKS}, {BLOCK_SIZE}, {spec.num_kv_heads}, {dim}]")
                if tensor.dtype != dtype:
                    raise _fail(member, f"{where}: dtype {tensor.dtype}, asked for {dtype}")
                if not _same_device(tensor.device, backend.device):
                    raise _fail(member, f"{where}: on {tensor.device}, the backend's device is {backend.device}")
            view = value_in_key(key, spec.value_in_key) if spec.value_in_key is not None else None
            if view is not None and (value.data_ptr(), value.stride()) != (view.data_ptr(), view.stride()):
                raise _fail(member, f"{spec}: the value must be a view of the key's last {spec.value_in_key} "
                            "features (core.kv_layout.value_in_key), not memory of its own")
            per_block = key.element_size() * key[0].numel() + (
                0 if spec.value_in_key is not None else value.element_size() * value[0].numel())
            if per_block != spec.bytes_per_token(dtype) * BLOCK_SIZE // spec.num_layers:
                raise _fail(member, f"{spec}: a block of layer {layer} holds {per_block} bytes, the spec's "
                            f"bytes_per_token says {spec.bytes_per_token(dtype) * BLOCK_SIZE // spec.num_layers}")
        _check_layers_apart(caches, spec)


def _check_layers_apart(caches: list[tuple[torch.Tensor, torch.Tensor]], spec: KVCacheSpec) -> None:
    """Writing one layer's cache changes no other layer's."""
    for tensor in (t for pair in caches for t in pair):
        tensor.zero_()
    caches[0][0].fill_(1)
    if spec.value_in_key is None:
        caches[0][1].fill_(2)
    for layer, (key, value) in enumerate(caches[1:], start=1):
        if bool(key.ne(0).any()) or bool(value.ne(0).any()):
            raise _fail("allocate_kv_cache", f"{spec}: layer {layer} shares memory with layer 0")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def paged_batch(device: torch.device, tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                block_size: int) -> ForwardBatch:
    """A step as the engine flattens it: each sequence's last ``query_len`` tokens, no attention metadata."""
    block_tables = torch.zeros(len(seq_lens), max(map(len, tables)), dtype=torch.int64)
    for row, blocks in enumerate(tables):
        block_tables[row, : len(blocks)] = torch.tensor(blocks)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)])
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    slots = block_tables[rows, positions // block_size] * block_size + positions % block_size
    return ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64, device=device), positions=positions.to(device),
        slot_mapping=slots.to(device), query_start_loc=starts.to(device), seq_lens=torch.tensor(seq_lens, device=device),
        block_tables=block_tables.to(device), logits_indices=(starts[1:] - 1).to(device), query_lens=list(query_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size)


def _check_attention(backend: DeviceBackend, dtype: torch.dtype, case: str, atol: float) -> None:
    member = f"paged_attention ({case}, {dtype})"
    latent = case == "latent"
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1 if latent else 2, head_dim=16, value_in_key=8 if latent else None)
    key_cache, value_cache = backend.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, dtype)[0]
    generator = torch.Generator().manual_seed(0)
    key_cache.copy_(torch.randn(key_cache.shape, generator=generator).to(dtype))
    if not latent:
        value_cache.copy_(torch.randn(value_cache.shape, generator=generator).to(dtype))
    count = 2 if case == "decode_only" else len(SEQ_LENS)
    tables, seq_lens, query_lens = TABLES[:count], SEQ_LENS[:count], QUERY_LENS[:count]
    tokens = sum(query_lens)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, 16, generator=generator).to(dtype).to(backend.device)

    query, key = draw(4), draw(spec.num_kv_heads)
    value = None if latent else draw(2)
    window, cap = (5, 2.0) if case == "window_soft_cap" else (None, None)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    if latent:
        expected_value = value_in_key(expected_key, 8)
    reference = paged_batch(backend.device, tables, seq_lens, query_lens, BLOCK_SIZE)
    reference.attention = attention_ops.paged_attention_metadata(reference)
    expected = attention_ops.paged_attention(kernels.KernelTable("reference"), query, key, value,
                                       (expected_key, expected_value), reference, 0.25, window, cap)
    batch = paged_batch(backend.device, tables, seq_lens, query_lens, BLOCK_SIZE)
    batch.attention = backend.prepare(batch)
    out = backend.paged_attention(query, key, value, (key_cache, value_cache), batch, 0.25, window, cap)
    backend.synchronize()
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (tokens, 4, 8 if latent else 16):
        raise _fail(member, f"expected a [{tokens}, 4, {8 if latent else 16}] tensor, got "
                    f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    if out.dtype != query.dtype:
        raise _fail(member, f"returned {out.dtype}, the query is {query.dtype}")
    error = (out.float() - expected.float()).abs().max().item()
    if not error <= atol + atol * expected.float().abs().max().item():
        raise _fail(member, f"differs from the kernel table's reference by {error:.3g} (tolerance {atol})")
    if not torch.equal(key_cache.cpu(), expected_key.cpu()) or (
            not latent and not torch.equal(value_cache.cpu(), expected_value.cpu())):
        raise _fail(member, "the cache after the step differs from the reference's write_kv: this step's keys and "
                    "values belong at batch.slot_mapping, every other slot untouched")


def _check_quantized_attention(backend: DeviceBackend, dtype: torch.dtype, atol: float) -> None:
    """A quantized cache the backend lists in ``kv_cache_dtypes``: its write gives the reference's bytes, its
    attention the reference's result (``layers/kv_quant.py``), with a float32 query."""
    member = f"paged_attention (quantized KV cache, {dtype})"
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16)
    key_cache, value_cache = backend.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, dtype)[0]
    if tuple(key_cache.shape[1:]) != (BLOCK_SIZE, 2, 16 + kv_quant.SCALE_BYTES) or key_cache.dtype != dtype:
        raise _fail("allocate_kv_cache", f"a {dtype} cache of blocks [{BLOCK_SIZE}, 2, {16 + kv_quant.SCALE_BYTES}] "
                    f"(codes, then the scale's bytes), got {key_cache.dtype} {tuple(key_cache.shape)}")
    generator = torch.Generator().manual_seed(1)
    slots = key_cache.shape[0] * BLOCK_SIZE  # a backend may hold blocks of its own beyond NUM_BLOCKS
    for cache in (key_cache, value_cache):  # earlier steps' rows
        kv_quant.write_rows(cache, torch.arange(slots, device=backend.device),
                            torch.randn(slots, 2, 16, generator=generator).to(backend.device))
    tokens = sum(QUERY_LENS)
    query, key, value = (torch.randn(tokens, heads, 16, generator=generator).to(backend.device) for heads in (4, 2, 2))
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    reference = paged_batch(backend.device, TABLES, SEQ_LENS, QUERY_LENS, BLOCK_SIZE)
    reference.attention = attention_ops.paged_attention_metadata(reference)
    expected = attention_ops.paged_attention(kernels.KernelTable("reference"), query, key, value,
                                       (expected_key, expected_value), reference, 0.25, None, None)
    batch = paged_batch(backend.device, TABLES, SEQ_LENS, QUERY_LENS, BLOCK_SIZE)
    batch.attention = backend.prepare(batch)
    out = backend.paged_attention(query, key, value, (key_cache, value_cache), batch, 0.25)
    backend.synchronize()
    error = (out.float() - expected.float()).abs().max().item()
    if not error <= atol + atol * expected.float().abs().max().item():
        raise _fail(member, f"differs from the kernel table's reference by {error:.3g} (tolerance {atol})")
    for name, mine, theirs in (("keys", key_cache, expected_key), ("values", value_cache, expected_value)):
        if not torch.equal(mine.view(torch.uint8).cpu(), theirs.view(torch.uint8).cpu()):
            raise _fail(member, f"the cache's {name} differ from the reference write's bytes (codes rounded to "
                        "nearest even from x / scale, the scale absmax / code max: layers/kv_quant.py)")


def _check_copy_blocks(backend: DeviceBackend, dtype: torch.dtype) -> None:
    member = "copy_blocks"
    for spec in (KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16),
                 KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=24, value_in_key=16)):
        caches = backend.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, dtype)
        generator = torch.Generator().manual_seed(1)
        for key, value in caches:
            key.copy_(torch.randn(key.shape, generator=generator).to(dtype))
            if spec.value_in_key is None:
                value.copy_(torch.randn(value.shape, generator=generator).to(dtype))
        before = [(key.cpu().clone(), value.cpu().clone()) for key, value in caches]
        backend.copy_blocks(caches, [])
        backend.synchronize()
        if any(not torch.equal(k.cpu(), bk) or not torch.equal(v.cpu(), bv)
               for (k, v), (bk, bv) in zip(caches, before)):
            raise _fail(member, f"{spec}: an empty list of copies changed the cache")
        copies = [(3, 12), (5, 0), (9, 14)]
        backend.copy_blocks(caches, copies)
        backend.synchronize()
        for layer, ((key, value), (old_key, old_value)) in enumerate(zip(caches, before)):
            want_key, want_value = old_key.clone(), old_value.clone()
            for src, dst in copies:
                want_key[dst] = old_key[src]
                want_value[dst] = old_value[src]
            if spec.value_in_key is not None:
                want_value = value_in_key(want_key, spec.value_in_key)
            if not torch.equal(key.cpu(), want_key) or not torch.equal(value.cpu(), want_value):
                raise _fail(member, f"{spec}, layer {layer}: after copies {copies} the cache is not the blocks "
                            "copied src -> dst with every other block untouched")


def _check_ops(backend: DeviceBackend, ops: Iterable[str]) -> None:
    for name in ops:
        kernel = backend.op(name)
        if not callable(kernel):
            raise _fail(f"op({name!r})", f"the backend claims this op; got {kernel!r}, not a callable")
        reference = kernels.OPS.get(name)
        if reference is None:
            # a backend's own op (the cpu backend's format ops): no reference signature to hold it to
            continue
        try:
            parameters = tuple(inspect.signature(kernel).parameters)
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        if parameters != reference.parameters:
            raise _fail(f"op({name!r})", f"takes ({', '.join(parameters)}); the op's signature is "
                        f"({', '.join(reference.parameters)})")
    try:
        unknown = backend.op(NOT_AN_OP)
    except KeyError:
        # an op no plugin defined is an error at build, naming the nearest ops
        return
    raise _fail(f"op({NOT_AN_OP!r})", f"an op name no plugin defined must raise KeyError, got {unknown!r}")


class _ToyDecoder:
    """One attention layer over the backend's paged cache, an embedding and a head: a model's decode step."""

    def __init__(self, backend: DeviceBackend, block_size: int, num_blocks: int) -> None:
        generator = torch.Generator().manual_seed(2)
        self.backend, self.vocab, self.heads, self.dim = backend, 32, 4, 16

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) * 0.5).to(backend.device)

        self.embed, self.qkv, self.head = weight(self.vocab, 64), weight(3 * 64, 64), weight(self.vocab, 64)
        spec = KVCacheSpec(num_layers=1, num_kv_heads=self.heads, head_dim=self.dim)
        self.cache = backend.allocate_kv_cache(spec, num_blocks, block_size, torch.float32)[0]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed[batch.input_ids]
        query, key, value = (hidden @ self.qkv.T).view(-1, 3, self.heads, self.dim).unbind(1)
        out = self.backend.paged_attention(query, key, value, self.cache, batch, self.dim ** -0.5)
        return out.reshape(-1, self.heads * self.dim)[batch.logits_indices]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head.T).float()


def _check_capture_decode(backend: DeviceBackend, atol: float) -> None:
    member = "capture_decode"
    toy = _ToyDecoder(backend, BLOCK_SIZE, NUM_BLOCKS)
    replay = backend.capture_decode(DecodeForward(toy.forward, toy.compute_logits), max_num_seqs=4,
                                    max_blocks_per_seq=4, block_size=BLOCK_SIZE)
    if replay is None:
        return
    if not callable(replay):
        raise _fail(member, f"None or a callable, got {type(replay).__name__}")
    tables, lengths = [[3, 1, 8], [7, 2, 9], [0, 4, 5]], [5, 2, 7]
    generator = torch.Generator().manual_seed(3)
    for step in range(4):
        # a backend may run a batch size eagerly first and record it later
        batch = paged_batch(backend.device, tables, lengths, [1] * len(lengths), BLOCK_SIZE)
        batch.input_ids.copy_(torch.randint(0, toy.vocab, (len(lengths),), generator=generator))
        before = [tensor[:NUM_BLOCKS].clone() for tensor in toy.cache]  # past them: a backend's scratch block
        eager = paged_batch(backend.device, tables, lengths, [1] * len(lengths), BLOCK_SIZE)
        eager.input_ids.copy_(batch.input_ids)
        eager.attention = backend.prepare(eager)
        with torch.inference_mode():
            expected = toy.compute_logits(toy.forward(eager))
        after = [tensor[:NUM_BLOCKS].clone() for tensor in toy.cache]
        for tensor, old in zip(toy.cache, before):
            tensor[:NUM_BLOCKS].copy_(old)
        got = replay(batch)
        backend.synchronize()
        if got is None:
            for tensor, new in zip(toy.cache, after):
                tensor[:NUM_BLOCKS].copy_(new)  # the worker would run this step eagerly
        else:
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
                raise _fail(member, f"step {step}: the replay gave "
                            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
                            f"the eager step's logits are {tuple(expected.shape)}")
            error = (got.float() - expected).abs().max().item()
            if not error <= atol * (1 + expected.abs().max().item()):
                raise _fail(member, f"step {step}: the replay's logits differ from the eager step's by {error:.3g}")
            # Close, not equal: a replay padded to a larger batch may round the key projection differently.
            if not all(torch.allclose(tensor[:NUM_BLOCKS].cpu(), new.cpu(), rtol=atol, atol=atol)
                       for tensor, new in zip(toy.cache, after)):
                raise _fail(member, f"step {step}: the replay left the KV cache unlike the eager step")
        lengths = [n + 1 for n in lengths]
