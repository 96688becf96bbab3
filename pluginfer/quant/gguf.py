"""The ``gguf`` quant method: linear layers keep a ``.gguf`` file's tensors in their GGML block types.

A fused layer (``qkv_proj``, ``gate_up_proj``) is loaded from several checkpoint tensors, and GGUF
files mix types (e.g. Q4_K q/k with a Q6_K v), so each shard keeps its own (type, raw blocks).
Adjacent shards of one type are concatenated once after loading; the matmul runs
``ggml_blocks.ggml_linear`` per group (a tile of rows dequantized at a time) and concatenates the
outputs. Float shards (F32/F16/BF16 files) are plain dense weights in the model dtype.

The checkpoint side is ``pluginfer.core.gguf_checkpoint`` (it yields ``GGMLTensor``s); the
embedding and the LM head arrive already dequantized (docs/quantization.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.layers.context import backend_op, current_context, has_context
from pluginfer.quant.ggml_blocks import DEQUANTIZABLE, DequantizeKernel, ggml_linear, row_bytes

_FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFLinear:
    name = "gguf"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        if layer.tp_size > 1:
            raise ValueError("quant method 'gguf' runs on one rank: GGUF checkpoints need "
                             "tensor_parallel_size 1")
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

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: object, shard_id: object = None) -> None:
        """Keep one checkpoint tensor (``GGMLTensor`` or dense) as shard ``shard_id`` of the layer's weight."""
        name = getattr(param, "checkpoint_name", "weight")
        index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)  # type: ignore[arg-type]
        sizes = getattr(layer, "output_sizes", None)
        rows = layer.output_size if index is None else sizes[index]
        if tuple(loaded.shape) != (rows, layer.input_size):
            raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected "
                             f"{(rows, layer.input_size)}")
        qtype = getattr(loaded, "qtype", None)
        if qtype is None:  # a float tensor: dense, in the model dtype
            layer.gguf_shards[index or 0] = (None, loaded.to(device=param.device, dtype=layer.gguf_dtype))
            return
        if qtype not in DEQUANTIZABLE or qtype.name in _FLOAT_TYPES:
            supported = ", ".join(sorted(t.name for t in DEQUANTIZABLE if t.name not in _FLOAT_TYPES))
            raise ValueError(f"{name}: GGML type {qtype.name} is not supported (supported: {supported})")
        expected = row_bytes(qtype, layer.input_size)
        if tuple(loaded.raw.shape) != (rows, expected):
            raise ValueError(f"{name}: {qtype.name} blocks of shape {tuple(loaded.raw.shape)}, expected "
                             f"{(rows, expected)}")
        layer.gguf_shards[index or 0] = (qtype, loaded.raw.to(param.device))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.gguf_shards:
            return  # already processed
        groups: list[tuple[object, list[torch.Tensor]]] = []
        for index in sorted(layer.gguf_shards):
            qtype, tensor = layer.gguf_shards[index]
            if groups and groups[-1][0] == qtype:
                groups[-1][1].append(tensor)
            else:
                groups.append((qtype, [tensor]))
        layer.gguf_groups = [(qtype, parts[0] if len(parts) == 1 else torch.cat(parts)) for qtype, parts in groups]
        layer.gguf_shards = {}
        del layer.weight  # the placeholder; the groups hold the weights

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        groups, kernel = layer.gguf_groups, getattr(layer, "ggml_dequantize", None)
        if len(groups) == 1:
            return _group_linear(x, *groups[0], layer.input_size, bias, kernel)
        out = torch.cat([_group_linear(x, qtype, weight, layer.input_size, None, kernel) for qtype, weight in groups],
                        dim=-1)
        return out if bias is None else out + bias


def _group_linear(x: torch.Tensor, qtype: object, weight: torch.Tensor, cols: int, bias: torch.Tensor | None,
                  kernel: DequantizeKernel | None) -> torch.Tensor:
    if qtype is None:
        return F.linear(x, weight, bias)
    return ggml_linear(x, weight, qtype, cols, bias, kernel)


def build(quant_config: dict | None = None) -> GGUFLinear:
    if quant_config and quant_config.get("quant_method") != "gguf":
        raise ValueError(f"quant method 'gguf' reads .gguf files; this checkpoint's quantization_config is "
                         f"{quant_config}")
    return GGUFLinear()
