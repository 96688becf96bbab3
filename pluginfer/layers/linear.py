"""Tensor-parallel linear layers; parameters and matmul come from the context's QuantMethod.

Column-parallel layers split the output features across ranks, row-parallel layers
split the input features and all-reduce the result. Each parameter carries a
``weight_loader`` that copies this rank's slice of a checkpoint tensor into it.
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.layers.context import current_context


def _check_shape(expected: torch.Tensor | torch.Size, loaded: torch.Tensor, name: str) -> None:
    shape = expected if isinstance(expected, torch.Size) else expected.shape
    if shape != loaded.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match expected {tuple(shape)}")


def _check_rank_slice(loaded: torch.Tensor, dim: int, full_size: int, name: str) -> None:
    """A tensor that is split across ranks must have its full size along ``dim`` before it is cut."""
    if loaded.dim() <= dim or loaded.shape[dim] != full_size:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not have {full_size} "
                         f"along axis {dim}")


def _packed(param: nn.Parameter, dim: int, *sizes: int) -> list[int]:
    """Sizes along ``dim`` in ``param``'s elements: a packed parameter holds ``packed_factor`` values in each."""
    if getattr(param, "packed_dim", None) != dim:
        return list(sizes)
    factor = param.packed_factor
    if any(size % factor for size in sizes):
        raise ValueError(f"{getattr(param, 'checkpoint_name', 'weight')}: a projection of {sizes} outputs does not "
                         f"split into words of {factor} packed values")
    return [size // factor for size in sizes]


class LinearBase(nn.Module):
    """``y = x W^T + b`` with W of ``output_size x input_size`` (this rank's shard)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, shard_dim: int | None) -> None:
        super().__init__()
        ctx = current_context()
        self.tp_rank, self.tp_size = ctx.collective.rank, ctx.collective.world_size
        self.collective = ctx.collective
        self.quant_method = ctx.quant
        self.shard_dim = shard_dim  # 0: outputs split, 1: inputs split, None: replicated
        self.input_size, self.output_size = input_size, output_size
        self.quant_method.create_weights(self, input_size, output_size, ctx.dtype)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):  # a quant method may install its own loader
                param.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=ctx.dtype), requires_grad=False)
            self.bias.output_dim = 0
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def _shard(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        dim = {0: getattr(param, "output_dim", None), 1: getattr(param, "input_dim", None)}.get(self.shard_dim)
        if dim is None or self.tp_size == 1:
            return loaded
        size = param.shape[dim]
        full = list(param.shape)
        full[dim] = size * self.tp_size
        _check_shape(torch.Size(full), loaded, getattr(param, "checkpoint_name", "weight"))
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        loaded = self._shard(param, loaded)
        _check_shape(param, loaded, getattr(param, "checkpoint_name", "weight"))
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, shard_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the result stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = current_context().collective.world_size
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tensor-parallel size {tp_size}")
        super().__init__(input_size, output_size // tp_size, bias, shard_dim=0)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial results are all-reduced (bias added once)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = current_context().collective.world_size
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tensor-parallel size {tp_size}")
        super().__init__(input_size // tp_size, output_size, bias, shard_dim=1)

    def _shard(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        if getattr(param, "output_dim", None) == 0 and getattr(param, "input_dim", None) is None:
            return loaded  # the bias is not split
        return super()._shard(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = self.collective.all_reduce(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def _offsets(self, shard_id: int) -> tuple[int, int]:
        sizes = [size // self.tp_size for size in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        dim = getattr(param, "output_dim", 0)
        if shard_id is None:
            if self.tp_size == 1:
                return super().weight_loader(param, loaded)
            # An already-fused checkpoint tensor: split it into its projections, then shard each.
            full_sizes = _packed(param, dim, *self._full_sizes())
            _check_rank_slice(loaded, dim, sum(full_sizes), getattr(param, "checkpoint_name", "weight"))
            for index, part in enumerate(loaded.split(full_sizes, dim=dim)):
                self.weight_loader(param, part, index)
            return
        offset, size = _packed(param, dim, *self._offsets(shard_id))
        target = param.data.narrow(dim, offset, size)
        name = f"{getattr(param, 'checkpoint_name', 'weight')}[shard {shard_id}]"
        if self.tp_size > 1:
            _check_rank_slice(loaded, dim, size * self.tp_size, name)
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        _check_shape(target, loaded, name)
        target.copy_(loaded)

    def _full_sizes(self) -> list[int]:
        """Each projection's size in the checkpoint (all ranks together)."""
        return list(self.output_sizes)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Query, key and value projections fused; KV heads are split (or replicated) across ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, v_head_dim: int | None = None) -> None:
        tp_size = current_context().collective.world_size
        if num_heads % tp_size:
            raise ValueError(f"num_attention_heads {num_heads} is not divisible by tensor-parallel size {tp_size}")
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        if num_kv_heads % tp_size and tp_size % num_kv_heads:
            raise ValueError(f"num_key_value_heads {num_kv_heads} and tensor-parallel size {tp_size} do not divide")
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        v_head_dim = v_head_dim or head_dim
        sizes = [num_heads * head_dim, self.num_kv_heads * tp_size * head_dim, self.num_kv_heads * tp_size * v_head_dim]
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        super().__init__(hidden_size, sizes, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)  # type: ignore[arg-type]
        if index is None or index == 0 or self.tp_size == 1:
            return super().weight_loader(param, loaded, index)
        dim = getattr(param, "output_dim", 0)
        offset, size, full_size = _packed(param, dim, *self._offsets(index), self._full_sizes()[index])
        name = f"{getattr(param, 'checkpoint_name', 'weight')}[{shard_id}]"
        _check_rank_slice(loaded, dim, full_size, name)
        kv_rank = self.tp_rank // self.kv_replicas  # ranks that share one KV head load the same slice
        loaded = loaded.narrow(dim, kv_rank * size, size)
        target = param.data.narrow(dim, offset, size)
        _check_shape(target, loaded, name)
        target.copy_(loaded)

    def _full_sizes(self) -> list[int]:
        kv_heads = self.num_kv_heads * self.tp_size // self.kv_replicas  # the checkpoint's KV heads
        return [self.num_heads * self.tp_size * self.head_dim, kv_heads * self.head_dim, kv_heads * self.v_head_dim]
