"""Linear layers with the unquantized method against ``torch.nn.functional.linear`` of the dense weight.

Tensor parallelism runs without communication: a fake collective says (rank, world_size) and its
all_reduce/all_gather are the identity, so every rank's partial output can be checked against the dense one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.backends.cpu import backend as cpu
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.context import building
from pluginfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pluginfer.layers.weights import load_named_weights
from pluginfer.quant import unquantized

TOLERANCE = dict(atol=1e-5, rtol=1e-5)
HIDDEN = 32


class FakeRank:
    """One rank of a world without communication; all_reduce records what it was asked to sum."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.reduced: list[torch.Tensor] = []

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.reduced.append(tensor.clone())
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def broadcast(self, obj: object, src: int = 0) -> object:
        return obj

    def barrier(self) -> None:
        pass


@functools.cache
def backend() -> cpu.CpuBackend:
    return cpu.build()


def build_on(collective: object, make: Callable[..., nn.Module], *args: object, **kwargs: object) -> nn.Module:
    ctx = BuildContext(backend=backend(), quant=unquantized.build(), collective=collective, dtype=torch.float32,
                       max_model_len=64)
    with building(ctx):
        return make(*args, **kwargs)


def ranks(world_size: int) -> list[object]:
    return [single.build()] if world_size == 1 else [FakeRank(r, world_size) for r in range(world_size)]


def finish(layer: nn.Module) -> nn.Module:
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def load(layer: nn.Module, name: str, tensor: torch.Tensor, shard_id: object = None) -> None:
    param = getattr(layer, name)
    if shard_id is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


def dense(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def x() -> torch.Tensor:
    return dense(5, HIDDEN, seed=100)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_column_parallel_concatenates_to_dense(world_size: int, bias: bool, x: torch.Tensor) -> None:
    weight, bias_tensor = dense(24, HIDDEN, seed=1), dense(24, seed=2) if bias else None
    outputs = []
    for collective in ranks(world_size):
        layer = build_on(collective, ColumnParallelLinear, HIDDEN, 24, bias=bias)
        assert layer.weight.shape == (24 // world_size, HIDDEN)
        load(layer, "weight", weight)
        if bias:
            load(layer, "bias", bias_tensor)
        outputs.append(finish(layer)(x))
    torch.testing.assert_close(torch.cat(outputs, dim=-1), F.linear(x, weight, bias_tensor), **TOLERANCE)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_row_parallel_partials_sum_to_dense_with_bias_once(world_size: int, bias: bool, x: torch.Tensor) -> None:
    inputs = 48
    weight, bias_tensor = dense(HIDDEN, inputs, seed=3), dense(HIDDEN, seed=4) if bias else None
    activations = dense(5, inputs, seed=5)
    expected = F.linear(activations, weight, bias_tensor)
    partials = []
    for collective in ranks(world_size):
        layer = build_on(collective, RowParallelLinear, inputs, HIDDEN, bias=bias)
        assert layer.weight.shape == (HIDDEN, inputs // world_size)
        load(layer, "weight", weight)
        if bias:
            load(layer, "bias", bias_tensor)
        shard = activations.chunk(world_size, dim=-1)[collective.rank]  # the column-parallel layer's output
        out = finish(layer)(shard)
        if world_size == 1:
            torch.testing.assert_close(out, expected, **TOLERANCE)
            continue
        assert len(collective.reduced) == 1, "one all_reduce per forward"
        partial = collective.reduced[0]
        partials.append(partial)
        # The bias is added after the reduction, so the reduced sum carries it exactly once.
        torch.testing.assert_close(out, partial + bias_tensor if bias else partial, **TOLERANCE)
    if world_size > 1:
        total = sum(partials)
        torch.testing.assert_close(total + bias_tensor if bias else total, expected, **TOLERANCE)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_merged_column_parallel_gate_up(world_size: int, bias: bool, x: torch.Tensor) -> None:
    intermediate = 40
    gate, up = dense(intermediate, HIDDEN, seed=6), dense(intermediate, HIDDEN, seed=7)
    gate_bias, up_bias = (dense(intermediate, seed=8), dense(intermediate, seed=9)) if bias else (None, None)
    gate_parts, up_parts = [], []
    for collective in ranks(world_size):
        layer = build_on(collective, MergedColumnParallelLinear, HIDDEN, [intermediate, intermediate], bias=bias)
        # Load up before gate: shards land at their own offsets whatever the order.
        load(layer, "weight", up, 1)
        load(layer, "weight", gate, 0)
        if bias:
            load(layer, "bias", up_bias, 1)
            load(layer, "bias", gate_bias, 0)
        gate_out, up_out = finish(layer)(x).chunk(2, dim=-1)
        gate_parts.append(gate_out)
        up_parts.append(up_out)
    torch.testing.assert_close(torch.cat(gate_parts, -1), F.linear(x, gate, gate_bias), **TOLERANCE)
    torch.testing.assert_close(torch.cat(up_parts, -1), F.linear(x, up, up_bias), **TOLERANCE)


QKV_CASES = {
    # name: (num_heads, num_kv_heads, head_dim, v_head_dim)
    "mha": (4, 4, 8, None),
    "gqa": (4, 2, 8, None),
    "gqa-kv-fewer-than-ranks": (4, 1, 8, None),
    "v-head-dim": (4, 2, 8, 12),
}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("case", list(QKV_CASES))
def test_qkv_parallel_splits_heads_and_replicates_kv(case: str, bias: bool, world_size: int,
                                                    x: torch.Tensor) -> None:
    heads, kv_heads, head_dim, v_head_dim = QKV_CASES[case]
    v_dim = v_head_dim or head_dim
    q_w, k_w, v_w = dense(heads * head_dim, HIDDEN, seed=10), dense(kv_heads * head_dim, HIDDEN, seed=11), dense(
        kv_heads * v_dim, HIDDEN, seed=12)
    q_b, k_b, v_b = (dense(heads * head_dim, seed=13), dense(kv_heads * head_dim, seed=14),
                     dense(kv_heads * v_dim, seed=15)) if bias else (None, None, None)
    q_dense = F.linear(x, q_w, q_b).view(5, heads, head_dim)
    k_dense = F.linear(x, k_w, k_b).view(5, kv_heads, head_dim)
    v_dense = F.linear(x, v_w, v_b).view(5, kv_heads, v_dim)
    q_parts = []
    for collective in ranks(world_size):
        layer = build_on(collective, QKVParallelLinear, HIDDEN, head_dim, heads, kv_heads, bias=bias,
                         v_head_dim=v_head_dim)
        assert layer.num_heads == heads // world_size
        assert layer.num_kv_heads == max(1, kv_heads // world_size)
        for shard, w, b in (("v", v_w, v_b), ("q", q_w, q_b), ("k", k_w, k_b)):
            load(layer, "weight", w, shard)
            if bias:
                load(layer, "bias", b, shard)
        out = finish(layer)(x)
        q, k, v = out.split([layer.num_heads * head_dim, layer.num_kv_heads * head_dim,
                             layer.num_kv_heads * v_dim], dim=-1)
        q_parts.append(q.view(5, layer.num_heads, head_dim))
        # This rank's KV heads: a slice of them, or (fewer KV heads than ranks) one head shared by several ranks.
        kv_per_rank = layer.num_kv_heads
        first = collective.rank * kv_heads // world_size if kv_heads >= world_size else (
            collective.rank // (world_size // kv_heads))
        expected_heads = slice(first, first + kv_per_rank)
        torch.testing.assert_close(k.view(5, kv_per_rank, head_dim), k_dense[:, expected_heads], **TOLERANCE)
        torch.testing.assert_close(v.view(5, kv_per_rank, v_dim), v_dense[:, expected_heads], **TOLERANCE)
    torch.testing.assert_close(torch.cat(q_parts, dim=1), q_dense, **TOLERANCE)




@pytest.mark.parametrize("world_size", [1, 2])
def test_already_fused_checkpoint_tensor_shards_each_projection(world_size: int, x: torch.Tensor) -> None:
    gate, up = dense(16, HIDDEN, seed=20), dense(16, HIDDEN, seed=21)
    q, k, v = dense(32, HIDDEN, seed=22), dense(16, HIDDEN, seed=23), dense(16, HIDDEN, seed=24)
    gate_parts, q_parts = [], []
    for collective in ranks(world_size):
        merged = build_on(collective, MergedColumnParallelLinear, HIDDEN, [16, 16])
        load(merged, "weight", torch.cat([gate, up]))
        gate_parts.append(finish(merged)(x).chunk(2, dim=-1)[0])
        qkv = build_on(collective, QKVParallelLinear, HIDDEN, 8, 4, 2)
        load(qkv, "weight", torch.cat([q, k, v]))
        q_parts.append(finish(qkv)(x)[:, : qkv.num_heads * 8])
    torch.testing.assert_close(torch.cat(gate_parts, -1), F.linear(x, gate), **TOLERANCE)
    torch.testing.assert_close(torch.cat(q_parts, -1), F.linear(x, q), **TOLERANCE)


def test_replicated_linear_is_whole_on_every_rank(x: torch.Tensor) -> None:
    weight, bias = dense(12, HIDDEN, seed=16), dense(12, seed=17)
    for collective in ranks(2):
        layer = build_on(collective, ReplicatedLinear, HIDDEN, 12, bias=True)
        load(layer, "weight", weight)
        load(layer, "bias", bias)
        torch.testing.assert_close(finish(layer)(x), F.linear(x, weight, bias), **TOLERANCE)


def test_three_dimensional_input_with_bias(x: torch.Tensor) -> None:
    weight, bias = dense(12, HIDDEN, seed=18), dense(12, seed=19)
    layer = build_on(single.build(), ColumnParallelLinear, HIDDEN, 12, bias=True)
    load(layer, "weight", weight)
    load(layer, "bias", bias)
    batched = x.view(1, 5, HIDDEN).expand(3, 5, HIDDEN)
    torch.testing.assert_close(finish(layer)(batched), F.linear(batched, weight, bias), **TOLERANCE)


def test_indivisible_sizes_are_errors() -> None:
    with pytest.raises(ValueError, match="output size 15"):
        build_on(FakeRank(0, 2), ColumnParallelLinear, HIDDEN, 15)
    with pytest.raises(ValueError, match="input size 15"):
        build_on(FakeRank(0, 2), RowParallelLinear, 15, HIDDEN)
    with pytest.raises(ValueError, match="num_attention_heads 3"):
        build_on(FakeRank(0, 2), QKVParallelLinear, HIDDEN, 8, 3, 3)
    with pytest.raises(ValueError, match="num_key_value_heads 3"):
        build_on(FakeRank(0, 2), QKVParallelLinear, HIDDEN, 8, 6, 3)


class _Block(nn.Module):
    """Checkpoint-named wrapper so load_named_weights routes and names the tensors."""

    def __init__(self, collective: object) -> None:
        super().__init__()
        self.qkv_proj = build_on(collective, QKVParallelLinear, HIDDEN, 8, 4, 2)
        self.o_proj = build_on(collective, RowParallelLinear, HIDDEN, HIDDEN)
        self.gate_up_proj = build_on(collective, MergedColumnParallelLinear, HIDDEN, [16, 16])
        self.column_proj = build_on(collective, ColumnParallelLinear, 16, HIDDEN)


def _checkpoint(**overrides: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
    shapes = {"q_proj": (32, HIDDEN), "k_proj": (16, HIDDEN), "v_proj": (16, HIDDEN), "o_proj": (HIDDEN, HIDDEN),
              "gate_proj": (16, HIDDEN), "up_proj": (16, HIDDEN), "column_proj": (HIDDEN, 16)}
    shapes.update(overrides)
    return [(f"layers.0.{name}.weight", torch.randn(*shape)) for name, shape in shapes.items()]


class _Model(nn.Module):
    def __init__(self, collective: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(collective)])


def test_well_shaped_checkpoint_loads_on_every_rank() -> None:
    for collective in [single.build(), FakeRank(0, 2), FakeRank(1, 2)]:
        load_named_weights(_Model(collective), _checkpoint())


# Wrong along an axis no rank splits: every rank can tell.
UNSHARDED_MISMATCHES = {"k_proj": (16, HIDDEN + 1), "o_proj": (HIDDEN + 4, HIDDEN), "up_proj": (16, 8),
                        "column_proj": (HIDDEN, 12)}
# Wrong along the axis ranks split: a rank that only narrows its slice never sees the whole tensor's shape.
SHARDED_MISMATCHES = {"q_proj": (48, HIDDEN), "k_proj": (24, HIDDEN), "v_proj": (8, HIDDEN),
                      "o_proj": (HIDDEN, HIDDEN + 8), "gate_proj": (24, HIDDEN), "column_proj": (HIDDEN + 8, 16)}

MISMATCH_CASES = (
    [pytest.param(name, shape, 1, 0, id=f"{name}-sharded-axis-tp1") for name, shape in SHARDED_MISMATCHES.items()]
    + [pytest.param(name, shape, 2, rank, id=f"{name}-unsharded-axis-tp2-rank{rank}")
       for name, shape in UNSHARDED_MISMATCHES.items() for rank in (0, 1)]
    + [pytest.param(name, shape, 2, rank, id=f"{name}-sharded-axis-tp2-rank{rank}")
       for name, shape in SHARDED_MISMATCHES.items() for rank in (0, 1)]
)


@pytest.mark.parametrize(("name", "shape", "world_size", "rank"), MISMATCH_CASES)
def test_checkpoint_shape_mismatch_is_a_value_error_naming_the_tensor(name: str, shape: tuple[int, ...],
                                                                      world_size: int, rank: int) -> None:
    collective = single.build() if world_size == 1 else FakeRank(rank, world_size)
    with pytest.raises(ValueError, match=rf"layers\.0\.{name}\.weight"):
        load_named_weights(_Model(collective), _checkpoint(**{name: shape}))
