"""The matmul shared by the weight-only int8 formats: dequantize a few output rows at a time.

Only one tile of ``rows x input_size`` floating-point weights exists at any moment, never a
layer's (let alone the model's) full dense weight. On the CPU this is also faster than
converting the whole int8 weight per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from pluginfer.core.protocols import ShardSpec
from pluginfer.quant.sharding import UNSPLIT

TILE_ROWS = 512
# one tile buffer per thread and dtype, grown to the largest tile seen
_scratch = threading.local()


def tile_buffer(elements: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A scratch buffer of at least ``elements`` in ``dtype`` for a native kernel to dequantize a tile into.

    One per thread and dtype, shared by every layer: each tile is consumed by its matmul before the next
    one is written.
    """
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < elements:
        buffer = buffers[dtype] = torch.empty(elements, dtype=dtype)
    return buffer


def tile_compute_dtype(x: torch.Tensor, kernel: object) -> torch.dtype:
    """The dtype a tile is dequantized to and multiplied in: ``x``'s, except float32 ``x`` of at least
    ``kernel.tile_dtype_min_rows`` rows where the backend's tile kernel asks for another (its ``tile_dtype``:
    bfloat16 on a CPU with AMX-BF16, where fewer rows gain nothing from it)."""
    dtype = getattr(kernel, "tile_dtype", None)
    if x.dtype != torch.float32 or dtype is None or dtype == x.dtype:
        return x.dtype
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return dtype if rows >= kernel.tile_dtype_min_rows else x.dtype


def tile_into_buffer(dtype: torch.dtype, kernel: object) -> bool:
    """Whether the backend's tile kernel writes ``dtype`` tiles straight into the shared :func:`tile_buffer`:
    float32 always, and its own ``tile_dtype``; any other dtype is converted after it (a tile is consumed by
    its matmul before the next is written, so one buffer serves every tile)."""
    return dtype == torch.float32 or dtype == getattr(kernel, "tile_dtype", None)


def tiled_linear(x: torch.Tensor, output_size: int, dequantize_rows: Callable[[int, int], torch.Tensor],
                 bias: torch.Tensor | None, tile_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` where ``dequantize_rows(start, stop)`` returns ``W[start:stop]`` in ``tile_dtype``
    (default ``x.dtype``). A ``tile_dtype`` other than ``x.dtype`` (bfloat16 tiles for float32 ``x``): ``x``
    is rounded to it once per call, each tile's GEMM runs in it (float32 sums inside torch's kernel) and
    its result, rounded to ``tile_dtype`` by torch (no CPU matmul writes float32 from bfloat16 inputs),
    lands in the ``x.dtype`` output; the bias is added in ``x.dtype``."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty(flat.shape[0], output_size, dtype=x.dtype, device=x.device)
    if tile_dtype is None or tile_dtype == x.dtype:
        for start in range(0, output_size, TILE_ROWS):
            stop = min(start + TILE_ROWS, output_size)
            torch.matmul(flat, dequantize_rows(start, stop).t(), out=out[:, start:stop])
    else:
        # one widening of the whole output at the end: faster than one per tile into strided columns
        low, low_out = flat.to(tile_dtype), torch.empty(flat.shape[0], output_size, dtype=tile_dtype, device=x.device)
        for start in range(0, output_size, TILE_ROWS):
            stop = min(start + TILE_ROWS, output_size)
            torch.matmul(low, dequantize_rows(start, stop).t(), out=low_out[:, start:stop])
        out.copy_(low_out)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], output_size)


def replace_weight(layer: torch.nn.Module, **params: torch.Tensor) -> None:
    """Drop the floating-point ``weight`` the checkpoint was loaded into; register the quantized tensors."""
    del layer.weight
    for name, tensor in params.items():
        param = torch.nn.Parameter(tensor, requires_grad=False)
        param.output_dim, param.input_dim = 0, 1
        layer.register_parameter(name, param)


class InSituQuantMethod:
    """Base of the formats quantized while loading: the checkpoint's float weight lands in a plain
    ``weight`` parameter; ``process_weights_after_loading`` quantizes it and frees the float copy.

    Under tensor parallelism the layer's loader cuts this rank's slice of the float weight (``output_dim`` /
    ``input_dim``) before it is quantized; a format with blocks along the inputs checks in
    ``create_weights`` that a row-parallel slice holds whole blocks (``sharding.check_input_split``).
    """

    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype, backend: object) -> None:
        """This format keeps no vocabulary tables (``QuantMethod.vocab_table``): embeddings stay dense."""
        return None

    def create_weights(self, layer: torch.nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)
