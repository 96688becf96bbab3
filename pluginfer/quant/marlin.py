"""The ``marlin`` quant method: 4-bit GPTQ/AWQ weights held in the Marlin tile layout.

It loads 4-bit GPTQ (symmetric, group 128 or -1, act-order only when ``g_idx`` is sorted), AWQ (gemm, zero
points) through their own methods, then repacks each complete layer (``marlin_layout.pack``); Marlin
checkpoints (``B`` ``[in / 16, out * 2]``, ``s`` ``[groups, out]``) load as stored. ``apply`` runs the backend's
``marlin_matmul`` where it has one, else dequantizes a few hundred columns at a time in torch. Under tensor
parallelism a Marlin ``B`` splits at 64 outputs and whole 16-row tiles and groups; a rank left with one group
re-permutes its scales to the single-group order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.context import quant_kernel
from pluginfer.layers.linear import projection_rows
from pluginfer.quant import marlin_layout as layout
from pluginfer.quant.sharding import UNSPLIT, check_input_split, column_split, row_split
from pluginfer.quant.tiled import tiled_linear

GROUP_SIZES = (128, -1)


def _is_marlin_checkpoint(config: dict) -> bool:
    return (config.get("quant_method") == "marlin" or config.get("checkpoint_format") == "marlin"
            or config.get("format") == "marlin" or bool(config.get("is_marlin_format")))


def check_config(config: dict) -> None:
    """ValueError naming each condition of ``quantization_config`` that Marlin cannot meet."""
    method = config.get("quant_method")
    if method not in ("gptq", "awq", "marlin"):
        raise ValueError(f"quant method 'marlin' takes GPTQ, AWQ or Marlin checkpoints, not quant_method {method!r}")
    failures = []
    bits = config.get("bits", config.get("w_bit", 4))
    if bits != 4:
        failures.append(f"bits: {bits} (Marlin holds 4-bit weights only)")
    group_size = config.get("group_size", config.get("q_group_size", 128))
    if group_size not in GROUP_SIZES:
        failures.append(f"group size: {group_size} (Marlin takes 128 or -1)")
    if method in ("gptq", "marlin") and config.get("sym") is False:
        failures.append("asym: sym is false (GPTQ Marlin takes symmetric weights; AWQ carries zero points)")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            failures.append(f"AWQ version: {version!r} (Marlin takes the GEMM packing)")
        if config.get("zero_point") is False:
            failures.append("AWQ zero_point: false (Marlin's AWQ path reads zero points)")
    if failures:
        raise ValueError("this checkpoint cannot run as 'marlin': " + "; ".join(failures))


def _unpack_gptq_rows(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight`` int32 ``[in / 8, out]`` (row ``8j + i`` in bits ``4i`` of word row ``j``) -> ``[in, out]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])


class MarlinLinear:
    """Marlin tiles ``B``, permuted scales ``s`` and, for AWQ, Marlin-ordered zero points ``z``."""

    name = "marlin"

    def __init__(self, group_size: int, source: object | None, zero_points: bool) -> None:
        self.group_size = group_size
        # the GPTQ/AWQ quant method that loads the checkpoint; None: already Marlin
        self.source = source
        self.zero_points = zero_points

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        check_input_split(shard, input_size, layout.TILE, f"Marlin's tile of {layout.TILE} inputs")
        if self.group_size != -1:
            check_input_split(shard, input_size, self.group_size, f"quantization_config.group_size {self.group_size}")
        if self.group_size != -1 and input_size % self.group_size:
            raise ValueError(f"marlin: group size {self.group_size} does not divide this layer's {input_size} inputs")
        if column_split(shard) and output_size % layout.CHUNK_COLUMNS:
            raise ValueError(f"parallel.tensor_parallel_size {shard.size} gives each rank {output_size} outputs of a "
                             f"layer of {sum(shard.output_sizes) or output_size * shard.size}, not a multiple of "
                             f"Marlin's runs of {layout.CHUNK_COLUMNS} outputs")
        layer.marlin_matmul = quant_kernel("marlin_matmul", self.name)
        if self.source is not None:
            self.source.create_weights(layer, input_size, output_size, dtype, shard)
            return
        if column_split(shard):  # each projection's B is cut into whole runs of 64 outputs
            for index in range(len(shard.output_sizes)):
                rows = projection_rows(shard, index)[1]
                if rows % layout.CHUNK_COLUMNS:
                    raise ValueError(f"parallel.tensor_parallel_size {shard.size} gives each rank {rows} outputs of "
                                     f"a {shard.output_sizes[index]}-output projection, not a multiple of Marlin's "
                                     f"runs of {layout.CHUNK_COLUMNS} outputs")
        layout.check_shape(input_size, output_size, self.group_size)
        # The inputs the checkpoint's scales were permuted for (their order depends on it).
        layer.marlin_checkpoint_k = input_size * shard.size if row_split(shard) else input_size
        packed = nn.Parameter(torch.empty(input_size // layout.TILE, output_size * 2, dtype=torch.int32),
                              requires_grad=False)
        packed.input_dim, packed.output_dim = 0, 1
        packed.weight_loader = self._tile_loader(layer)
        groups = 1 if self.group_size == -1 else input_size // self.group_size
        scales = nn.Parameter(torch.empty(groups, output_size, dtype=dtype), requires_grad=False)
        scales.input_dim, scales.output_dim = (0 if self.group_size != -1 else None), 1
        layer.register_parameter("B", packed)
        layer.register_parameter("s", scales)

    @staticmethod
    def _tile_loader(layer: nn.Module) -> Callable[..., None]:
        """Load ``B`` through the layer's own loader, seen as ``[in / 16, out, 2]``: two words per output.

        Marlin's permutation stays within runs of 64 outputs, so a slice of outputs (a tensor-parallel
        shard, one projection of a fused layer) is the same slice of ``B``'s column pairs.
        """
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
            paired = nn.Parameter(param.data.view(param.shape[0], -1, 2), requires_grad=False)
            paired.input_dim, paired.output_dim = 0, 1
            paired.checkpoint_name = getattr(param, "checkpoint_name", "B")
            loaded = loaded.reshape(loaded.shape[0], -1, 2)
            if shard_id is None:
                layer.weight_loader(paired, loaded)
            else:
                layer.weight_loader(paired, loaded, shard_id)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "marlin_group_size", None) is not None:
            return  # an earlier call
        if "B" in layer._parameters:  # a Marlin checkpoint
            size_k = layer.B.shape[0] * layout.TILE
            full_k = getattr(layer, "marlin_checkpoint_k", size_k)
            if layout.grouped_scales(full_k, self.group_size) != layout.grouped_scales(size_k, self.group_size):
                column_order = layout.unpermute_scales(layer.s.data, full_k, self.group_size)
                layer.s.data = layout.permute_scales(column_order, size_k, self.group_size)
            layer.marlin_group_size = self.group_size
            return
        checkpoint = getattr(layer.qweight, "checkpoint_name", "a layer").removesuffix(".qweight")
        self.source.process_weights_after_loading(layer)
        codes = _unpack_gptq_rows(layer.qweight.data)
        size_k, size_n = codes.shape
        zeros = layout.unpack_int4_columns(layer.qzeros.data)
        group_size = self.group_size if self.group_size != -1 else size_k
        g_idx = getattr(layer, "g_idx", None)
        if g_idx is not None:
            expected = torch.arange(size_k, device=g_idx.device) // group_size
            if not torch.equal(g_idx.to(expected.dtype), expected):
                raise ValueError(f"marlin: act-order: {checkpoint}'s g_idx is not sorted (i // {group_size}); "
                                 "Marlin reads groups in input order")
        if not self.zero_points and not bool((zeros == 8).all()):
            raise ValueError(f"marlin: asym: {checkpoint} has zero points other than 8; Marlin's GPTQ path is "
                             "symmetric (load it with --quant gptq)")
        layout.check_shape(size_k, size_n, self.group_size)
        packed, scales = layout.pack(codes, layer.scales.data, self.group_size)
        tensors = {"B": packed, "s": scales}
        if self.zero_points:
            tensors["z"] = layout.pack_zero_points(zeros)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if name in layer._parameters:
                delattr(layer, name)
        for name, tensor in tensors.items():
            layer.register_parameter(name, nn.Parameter(tensor.contiguous(), requires_grad=False))
        layer.marlin_group_size = self.group_size

    def dequantize_columns(self, layer: nn.Module, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """``W[start:stop]`` (``[rows, in]``); ``start``/``stop`` on 64-output boundaries."""
        zeros = getattr(layer, "z", None)
        if zeros is not None:
            zeros = zeros[:, start // layout.PACK:stop // layout.PACK]
        weight = layout.dequantize(layer.B[:, 2 * start:2 * stop], layer.s[:, start:stop],
                                   layer.B.shape[0] * layout.TILE, stop - start, layer.marlin_group_size, zeros, dtype)
        return weight.t()

    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype, backend: object) -> None:
        """This format keeps no vocabulary tables (``QuantMethod.vocab_table``): embeddings stay dense."""
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.marlin_matmul is not None:
            return layer.marlin_matmul(x, layer.B, layer.s.to(x.dtype), layer.marlin_group_size,
                                       getattr(layer, "z", None), bias, layout.position_table(x.device))
        return tiled_linear(x, layer.s.shape[1], lambda start, stop: self.dequantize_columns(layer, start, stop,
                                                                                              x.dtype), bias)


def build(quant_config: dict | None = None) -> MarlinLinear:
    if not quant_config:
        raise ValueError("quant method 'marlin' needs a GPTQ, AWQ or Marlin checkpoint (quantization_config); "
                         "this one is not quantized")
    check_config(quant_config)
    group_size = quant_config.get("group_size", quant_config.get("q_group_size", 128))
    if _is_marlin_checkpoint(quant_config):
        return MarlinLinear(group_size, None, zero_points=False)
    if quant_config["quant_method"] == "awq":
        from pluginfer.quant.awq import build as build_awq

        return MarlinLinear(group_size, build_awq(quant_config), zero_points=True)
    from pluginfer.quant.gptq import build as build_gptq

    return MarlinLinear(group_size, build_gptq(quant_config), zero_points=False)
