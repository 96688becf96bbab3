"""Tensor-parallel linear layers; parameters and matmul come from the context's QuantMethod.

Column-parallel layers split the outputs, row-parallel ones the inputs (then all-reduce); each parameter's
``weight_loader`` copies this rank's slice. A layer describes its split as a ``ShardSpec`` (``layer.shard``)
for ``QuantMethod.create_weights``; ``projection_rows(shard, index)`` alone says which rows of a fused
projection a rank holds. ``lora`` (None, or a ``layers.lora.LoRALayer``) adds the adapters' deltas to the
base output, whatever quant method computed it.
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.protocols import ShardSpec
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


def projection_rows(shard: ShardSpec, index: int) -> tuple[int, int, int]:
    """Projection ``index`` of a layer split as ``shard``: (first checkpoint row this rank holds, rows, offset).

    Rows count output features of the checkpoint tensor of that projection (``shard.output_sizes[index]``
    of them, all ranks); the offset is where they start in this rank's fused weight. Unless the outputs
    are split (``shard.dim == 0`` over several ranks) a rank holds every row. Every projection after the
    first (k and v of a QKV layer) is shared by ``shard.kv_replicas`` consecutive ranks.
    """
    def part(i: int) -> tuple[int, int]:
        full = shard.output_sizes[i]
        if shard.dim != 0 or shard.size == 1:
            return 0, full
        replicas = shard.kv_replicas if i > 0 else 1
        rows = full * replicas // shard.size
        return (shard.rank // replicas) * rows, rows

    start, rows = part(index)
    return start, rows, sum(part(i)[1] for i in range(index))


class LinearBase(nn.Module):
    """``y = x W^T + b`` with W of ``output_size x input_size`` (this rank's shard)."""

    lora = None  # the LoRA hook (see the module docstring)

    def __init__(self, input_size: int, output_size: int, bias: bool, shard_dim: int | None) -> None:
        super().__init__()
        ctx = current_context()
        self.tp_rank, self.tp_size = ctx.collective.rank, ctx.collective.world_size
        self.collective = ctx.collective
        self.quant_method = ctx.quant
        self.shard_dim = shard_dim  # 0: outputs split, 1: inputs split, None: replicated
        self.input_size, self.output_size = input_size, output_size
        # What the quant method learns of the split (the full sizes of fused projections included).
        self.shard = ShardSpec(dim=shard_dim, rank=self.tp_rank, size=self.tp_size,
                               output_sizes=tuple(self._full_sizes()), kv_replicas=getattr(self, "kv_replicas", 1))
        self.quant_method.create_weights(self, input_size, output_size, ctx.dtype, self.shard)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):  # a quant method may install its own loader
                param.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=ctx.dtype), requires_grad=False)
            self.bias.output_dim = 0
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def _full_sizes(self) -> list[int]:
        """Each projection's size in the checkpoint (all ranks together)."""
        return [self.output_size * self.tp_size if self.shard_dim == 0 else self.output_size]

    def _shard(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        dim = {0: getattr(param, "output_dim", None), 1: getattr(param, "input_dim", None)}.get(self.shard.dim)
        if dim is None or not self.shard.is_split:
            return loaded
        size = param.shape[dim]
        full = list(param.shape)
        full[dim] = size * self.shard.size
        _check_shape(torch.Size(full), loaded, getattr(param, "checkpoint_name", "weight"))
        return loaded.narrow(dim, self.shard.rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        loaded = self._shard(param, loaded)
        _check_shape(param, loaded, getattr(param, "checkpoint_name", "weight"))
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora(x, out)


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
            out = self.quant_method.apply(self, x, self.bias)
            return out if self.lora is None else self.lora(x, out)
        out = self.quant_method.apply(self, x, None)
        if self.lora is not None:  # this rank's inputs' share of the delta, summed with the base's
            out = self.lora(x, out)
        out = self.collective.all_reduce(out)
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def _projection(self, shard_id: object) -> int | None:
        """The index in ``output_sizes`` of the projection a checkpoint tensor is (None: all of them, fused)."""
        return shard_id  # type: ignore[return-value]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        index = self._projection(shard_id)
        dim = getattr(param, "output_dim", 0)
        name = getattr(param, "checkpoint_name", "weight")
        if index is None:
            if not self.shard.is_split:
                return super().weight_loader(param, loaded)
            # An already-fused checkpoint tensor: split it into its projections, then shard each.
            full_sizes = _packed(param, dim, *self.shard.output_sizes)
            _check_rank_slice(loaded, dim, sum(full_sizes), name)
            for i, part in enumerate(loaded.split(full_sizes, dim=dim)):
                self.weight_loader(param, part, i)
            return
        start, rows, offset, full = _packed(param, dim, *projection_rows(self.shard, index),
                                            self.shard.output_sizes[index])
        name = f"{name}[{shard_id}]" if isinstance(shard_id, str) else f"{name}[shard {shard_id}]"
        if self.shard.is_split:
            _check_rank_slice(loaded, dim, full, name)
            loaded = loaded.narrow(dim, start, rows)  # ranks that share one KV head load the same slice
        target = param.data.narrow(dim, offset, rows)
        _check_shape(target, loaded, name)
        target.copy_(loaded)

    def _full_sizes(self) -> list[int]:
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

    def _projection(self, shard_id: object) -> int | None:
        return {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)  # type: ignore[arg-type]

    def _full_sizes(self) -> list[int]:
        kv_heads = self.num_kv_heads * self.tp_size // self.kv_replicas  # the checkpoint's KV heads
        return [self.num_heads * self.tp_size * self.head_dim, kv_heads * self.head_dim, kv_heads * self.v_head_dim]
