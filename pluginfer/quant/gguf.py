"""The ``gguf`` quant method: linear layers keep a ``.gguf`` file's tensors in their GGML block types.

Each shard of a fused layer keeps its own (type, raw blocks), since files mix types; adjacent shards of one
type are read once into a group (``pread``: their pages never enter the process) and ``ggml_blocks.ggml_linear``
runs per group. F16/BF16 shards of a float32 model stay as stored where the backend has ``half_linear``; other
float shards are dense. Embedding and LM head stay quantized too (``vocab_table``). Under tensor parallelism a
column-parallel rank keeps its rows of blocks and a row-parallel rank its columns of bytes, which must be
whole blocks (else loading stops, naming the tensor, the sizes and the block).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.core.protocols import ShardSpec
from pluginfer.formats.gguf.checkpoint import read_file_bytes, release_file_pages, shares_memory
from pluginfer.layers.context import backend_op, current_context, has_context
from pluginfer.layers.linear import projection_rows
from pluginfer.quant.ggml_blocks import (
    DEQUANTIZABLE,
    DequantizeKernel,
    block_size,
    dequantize,
    ggml_linear,
    row_bytes,
)
from pluginfer.quant.ggml_ops import MATMUL_OPS
from pluginfer.quant.sharding import UNSPLIT, column_split, row_split, split_error
from pluginfer.quant.tiled import tiled_linear

_FLOAT_TYPES = ("F32", "F16", "BF16")
_HALF_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


class GGUFLinear:
    name = "gguf"
    # MoE experts stay in the file's blocks too: one layer of this method per expert and projection.
    holds_experts = True

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        # load_shard cuts each whole checkpoint tensor to this rank's part
        layer.shard = shard
        # A placeholder the loader routes checkpoint tensors to; the blocks land in ``layer.gguf_shards``.
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        weight.weight_loader = functools.partial(self.load_shard, layer)
        layer.register_parameter("weight", weight)
        layer.gguf_dtype = dtype
        layer.gguf_shards = {}
        layer.gguf_groups = []
        # The backend's native tile dequantization, if it has one (None: the torch path).
        layer.ggml_dequantize = backend_op(current_context().backend, "ggml_dequantize") if has_context() else None
        # The backend's 16-bit GEMV, where it has one: F16/BF16 tensors of a float32 model stay 16-bit for it,
        # and a 16-bit model's 16-bit linears take it as its HF checkpoint's do.
        layer.gguf_half = backend_op(current_context().backend, "half_linear") \
            if has_context() and dtype in (torch.float32, torch.float16, torch.bfloat16) else None
        # The backend's own layout for those in a float32 model, where it has one (packed after loading).
        layer.gguf_half_panels = _half_panel_ops(current_context().backend) \
            if has_context() and dtype == torch.float32 else None
        # Per GGML type, the backend's kernel reading its blocks (op ggml_<type>_matmul), found as shards load.
        layer.gguf_backend = current_context().backend if has_context() else None
        layer.gguf_matmuls = {}

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: object, shard_id: object = None) -> None:
        """Keep this rank's part of one whole checkpoint tensor (``GGMLTensor`` or dense) as shard ``shard_id``."""
        name = getattr(param, "checkpoint_name", "weight")
        shard = getattr(layer, "shard", UNSPLIT)
        index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)  # type: ignore[arg-type]
        sizes = shard.output_sizes or tuple(getattr(layer, "output_sizes", None) or (layer.output_size,))
        if index is None and len(sizes) > 1 and column_split(shard):
            # An already-fused tensor on a rank holding part of each projection: cut it into projections.
            self._check_shape(name, loaded, sum(sizes), layer.input_size)
            start = 0
            for i, rows in enumerate(sizes):
                self.load_shard(layer, param, _rows(loaded, start, rows), i)
                start += rows
            return
        source = getattr(loaded, "raw", loaded)  # the checkpoint's tensor: a view of the file's mapping
        full_rows = sum(sizes) if index is None else sizes[index]
        inputs = layer.input_size * (shard.size if row_split(shard) else 1)
        self._check_shape(name, loaded, full_rows, inputs)
        qtype = getattr(loaded, "qtype", None)
        if qtype is not None:
            if qtype not in DEQUANTIZABLE or qtype.name in _FLOAT_TYPES:
                supported = ", ".join(sorted(t.name for t in DEQUANTIZABLE if t.name not in _FLOAT_TYPES))
                raise ValueError(f"{name}: GGML type {qtype.name} is not supported (supported: {supported})")
            block = block_size(qtype)
            if row_split(shard) and layer.input_size % block:
                raise split_error(shard, layer.input_size, f"the {qtype.name} block of {block} inputs", name)
            expected = row_bytes(qtype, inputs)
            if tuple(loaded.raw.shape) != (full_rows, expected):
                raise ValueError(f"{name}: {qtype.name} blocks of shape {tuple(loaded.raw.shape)}, expected "
                                 f"{(full_rows, expected)}")
            self._find_matmul(layer, qtype, name)
        if column_split(shard):  # (index None here: a layer of one projection)
            start, rows, _ = projection_rows(shard, index or 0)
            loaded = _rows(loaded, start, rows)
        if row_split(shard):
            loaded = _columns(loaded, shard.rank * layer.input_size, layer.input_size)
        if qtype is None and _keeps_half(layer, loaded, param.device):  # read in place by the 16-bit GEMV
            kept = loaded
        elif qtype is None:  # a float tensor: dense, in the model dtype
            kept = loaded.to(device=param.device, dtype=layer.gguf_dtype)
        else:
            kept = loaded.raw.to(param.device)
        layer.gguf_shards[index or 0] = (qtype, kept)
        if not shares_memory(kept, source):
            # a rank's columns, another dtype or device: the file's pages can go
            release_file_pages(source)

    @staticmethod
    def _find_matmul(layer: nn.Module, qtype: object, name: str) -> None:
        """The backend's kernel for this GGML type's blocks; where the backend runs quantized weights only
        through its kernels (``quant_kernels_required``) and has none, loading stops naming both."""
        backend = getattr(layer, "gguf_backend", None)
        if backend is None or qtype in layer.gguf_matmuls:
            return
        op_name = MATMUL_OPS.get(qtype)
        kernel = backend.op(op_name) if op_name is not None else None
        if kernel is None and backend.quant_kernels_required:
            raise ValueError(f"{name}: backend {backend.name!r} has no kernel for quant format 'gguf' {qtype.name} "
                             f"(op {op_name or 'none defined for this type'}); choose another --backend, or a file "
                             "of other types")
        layer.gguf_matmuls[qtype] = kernel

    @staticmethod
    def _check_shape(name: str, loaded: object, rows: int, cols: int) -> None:
        if tuple(loaded.shape) != (rows, cols):
            raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected {(rows, cols)}")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.gguf_shards:
            return  # already processed
        groups: list[tuple[object, list[torch.Tensor]]] = []
        for index in sorted(layer.gguf_shards):
            qtype, tensor = layer.gguf_shards[index]
            if groups and groups[-1][0] == qtype and groups[-1][1][0].dtype == tensor.dtype:
                groups[-1][1].append(tensor)
            else:
                groups.append((qtype, [tensor]))
        layer.gguf_groups = [(qtype, parts[0] if len(parts) == 1 else _concatenate(parts)) for qtype, parts in groups]
        ops = getattr(layer, "gguf_half_panels", None)
        if ops is not None:
            layer.gguf_groups = [(qtype, _packed_half(weight, *ops) if qtype is None else weight)
                                 for qtype, weight in layer.gguf_groups]
        layer.gguf_shards = {}
        del layer.weight  # the placeholder; the groups hold the weights

    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype,
                    backend: object | None) -> GGMLVocabTable:
        """Rows ``start:start + rows`` of a quantized embedding or LM head (``QuantMethod.vocab_table``)."""
        qtype, name = getattr(loaded, "qtype", None), getattr(loaded, "name", "vocabulary table")
        if qtype is None or qtype not in DEQUANTIZABLE:
            supported = ", ".join(sorted(t.name for t in DEQUANTIZABLE))
            raise ValueError(f"{name}: GGML type {getattr(qtype, 'name', qtype)} is not supported "
                             f"(supported: {supported})")
        cols = loaded.shape[1]
        expected = row_bytes(qtype, cols)
        if tuple(loaded.raw.shape) != (loaded.shape[0], expected):
            raise ValueError(f"{name}: {qtype.name} blocks of shape {tuple(loaded.raw.shape)}, expected "
                             f"{(loaded.shape[0], expected)}")
        kernel = backend_op(backend, "ggml_dequantize") if backend is not None else None
        # F16/BF16 rows: the backend's 16-bit GEMV for the head, if it has one
        half, own = None, _HALF_TYPES.get(qtype.name)
        if backend is not None and own is not None and dtype in (torch.float32, own):
            half = backend_op(backend, "half_linear")
        raw = loaded.raw[start:start + rows]  # a view of the mapped file on the CPU: no copy
        device = getattr(backend, "device", None)
        kept = raw if device is None else raw.to(device)
        if not shares_memory(kept, raw):
            release_file_pages(raw)
        table = GGMLVocabTable(kept, qtype, cols, dtype, kernel, half)
        ops = _half_panel_ops(backend) if half is not None and dtype == torch.float32 else None
        if ops is not None:  # the head in the backend's layout; the embedding still reads the file's rows
            packed = _packed_half(table.half_weight, *ops)
            table.head = packed if isinstance(packed, PackedHalf) else None
        return table

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        groups, kernel = layer.gguf_groups, getattr(layer, "ggml_dequantize", None)
        matmuls, half = getattr(layer, "gguf_matmuls", {}), getattr(layer, "gguf_half", None)
        if len(groups) == 1:
            return _group_linear(x, *groups[0], layer.input_size, bias, kernel, matmuls.get(groups[0][0]), half)
        out = torch.cat([_group_linear(x, qtype, weight, layer.input_size, None, kernel, matmuls.get(qtype), half)
                         for qtype, weight in groups], dim=-1)
        return out if bias is None else out + bias


class GGMLVocabTable:
    """Rows of a GGUF embedding or LM head kept in their GGML blocks (a view of the file's mapped bytes).

    ``embed`` dequantizes only the rows it gathers; ``logits`` is ``ggml_linear``, the matmul of the other
    linears (the fused int8-activation kernel for short steps where the backend has it). F16/BF16 rows
    in a float32 model (or one of their own dtype), where the backend has the ``half_linear`` op
    (``half``), take ``half_weight_linear`` instead: the 16-bit weights read in place.
    A tied model passes one table to its embedding and its head."""

    def __init__(self, raw: torch.Tensor, qtype: object, cols: int, dtype: torch.dtype,
                 kernel: DequantizeKernel | None, half: Callable | None = None) -> None:
        self.raw, self.qtype, self.cols, self.dtype, self.kernel = raw, qtype, cols, dtype, kernel
        self.rows = raw.shape[0]
        self.half = half
        self.half_weight = raw.view(_HALF_TYPES[qtype.name]) if half is not None else None
        self.head: PackedHalf | None = None  # the 16-bit rows in the backend's layout, for the logits

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        picked = self.raw.index_select(0, ids.reshape(-1))
        dense = self.kernel(picked, int(self.qtype), self.cols, None) if self.kernel is not None else None
        if dense is None:
            dense = dequantize(picked, self.qtype, self.cols, self.dtype)
        return dense.to(self.dtype).reshape(*ids.shape, self.cols)

    def logits(self, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.head is not None:
            return self.head(hidden, bias)
        if self.half is not None:
            return half_weight_linear(hidden, self.half_weight, bias, self.half)
        return ggml_linear(hidden, self.raw, self.qtype, self.cols, bias, self.kernel)


def _concatenate(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' rows in one tensor. A part that is a view of the ``.gguf`` file's mapping is read from the
    file into its rows (``pread``: its pages never enter the process, and it is much faster than faulting
    them in on a busy machine); pages it was read through before (a part
    copied from the mapping) are released."""
    group = torch.empty(sum(part.shape[0] for part in parts), *parts[0].shape[1:], dtype=parts[0].dtype,
                        device=parts[0].device)
    start = 0
    for part in parts:
        rows = group[start:start + part.shape[0]]
        if not read_file_bytes(part, rows):
            rows.copy_(part)
        release_file_pages(part)
        start += part.shape[0]
    return group


def _rows(loaded: object, start: int, rows: int) -> object:
    """Rows ``start:start + rows`` of a dense tensor or a ``GGMLTensor`` (its rows of blocks: a view)."""
    qtype = getattr(loaded, "qtype", None)
    if qtype is None:
        return loaded[start:start + rows]
    return dataclasses.replace(loaded, raw=loaded.raw[start:start + rows],
                               shape=torch.Size([rows, loaded.shape[1]]))


def _columns(loaded: object, start: int, cols: int) -> object:
    """Input columns ``start:start + cols`` (whole blocks) of a dense tensor or a ``GGMLTensor`` (a copy)."""
    qtype = getattr(loaded, "qtype", None)
    if qtype is None:
        return loaded[:, start:start + cols]
    first, width = row_bytes(qtype, start), row_bytes(qtype, cols)
    return dataclasses.replace(loaded, raw=loaded.raw[:, first:first + width].contiguous(),
                               shape=torch.Size([loaded.shape[0], cols]))


def _keeps_half(layer: nn.Module, loaded: torch.Tensor, device: torch.device) -> bool:
    """Whether a float checkpoint tensor stays as the file stores it: F16/BF16 in a float32 model whose
    backend has the ``half_linear`` op, on the CPU (a view of the file's mapping, read in place)."""
    return getattr(layer, "gguf_half", None) is not None and layer.gguf_dtype == torch.float32 \
        and loaded.dtype in _HALF_TYPES.values() and loaded.device.type == "cpu" and torch.device(device).type == "cpu"


def half_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       half: Callable) -> torch.Tensor:
    """``x @ W.T + bias`` for a 16-bit ``weight`` (read in place in a float32 model): the backend's ``half_linear``
    op (its GEMV for a few rows; on AMX-BF16 its tiles up to a measured row count, prefill included),
    else ``F.linear`` for ``x`` of ``W``'s dtype, else tiles of ``W`` widened to ``x``'s dtype (exact for float32)
    for torch's GEMM."""
    out = half(x, weight, bias)
    if out is not None:
        return out
    if x.dtype == weight.dtype:
        return F.linear(x, weight, bias)
    return tiled_linear(x, weight.shape[0], lambda start, stop: weight[start:stop].to(x.dtype), bias)


class PackedHalf:
    """An F16/BF16 weight of a float32 model in its backend's layout (op ``ggml_half_pack``), called as its
    linear (op ``ggml_half_linear``)."""

    def __init__(self, packed: torch.Tensor, out_features: int, linear: Callable) -> None:
        self.packed, self.out_features, self.linear = packed, out_features, linear

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.linear(x, self.packed, self.out_features, bias)


def _half_panel_ops(backend: object | None) -> tuple[Callable, Callable] | None:
    """The backend's (``ggml_half_pack``, ``ggml_half_linear``), or None where it lacks either."""
    if backend is None:
        return None
    pack, linear = backend_op(backend, "ggml_half_pack"), backend_op(backend, "ggml_half_linear")
    return None if pack is None or linear is None else (pack, linear)


def _packed_half(weight: torch.Tensor, pack: Callable, linear: Callable) -> torch.Tensor | PackedHalf:
    """A 16-bit weight packed by the backend (its file pages released), or the weight where it declines."""
    if weight.dtype not in _HALF_TYPES.values():
        return weight
    packed = pack(weight)
    if packed is None:
        return weight
    release_file_pages(weight)
    return PackedHalf(packed, weight.shape[0], linear)


def _group_linear(x: torch.Tensor, qtype: object, weight: torch.Tensor | PackedHalf, cols: int,
                  bias: torch.Tensor | None, kernel: DequantizeKernel | None, matmul: Callable | None = None,
                  half: Callable | None = None) -> torch.Tensor:
    if isinstance(weight, PackedHalf):
        return weight(x, bias)
    if qtype is None:
        if half is not None and weight.dtype in _HALF_TYPES.values():  # the backend's 16-bit GEMV, F.linear above
            return half_weight_linear(x, weight, bias, half)
        return F.linear(x, weight, bias)
    if matmul is not None:
        # a device kernel reading the blocks (the cuda backend's Q8_0 / Q4_0)
        return matmul(x, weight, cols, bias)
    return ggml_linear(x, weight, qtype, cols, bias, kernel)


def build(quant_config: dict | None = None) -> GGUFLinear:
    if quant_config and quant_config.get("quant_method") != "gguf":
        raise ValueError(f"quant method 'gguf' reads .gguf files; this checkpoint's quantization_config is "
                         f"{quant_config}")
    return GGUFLinear()
