"""The harness of the tensor-parallel quant tests (``test_tensor_parallel.py``: in-situ methods and GGUF;
``test_tensor_parallel_groups.py``: GPTQ, AWQ, Marlin): the same layer on 2 and 4 thread ranks against one.

Each rank is a thread of ``pluginfer.testing.threads.run_ranks`` (a real ``Collective``: the
row-parallel all-reduce sums the ranks' partial outputs, in rank order). Every rank builds the
layer in its own ``BuildContext`` (its ``RankInfo`` and thread collective) and loads the SAME full
checkpoint tensors; the layer's quant method cuts its part. Two things are checked:

- **The weights are the one-rank weights, bit for bit.** A rank's dense weight is read back
  exactly by running its quant method on the identity matrix (each output is ``1 * w`` plus
  zeros, exact in float32). Column-parallel ranks hold their rows of each fused projection (key
  and value heads replicated when there are fewer of them than ranks), row-parallel ranks their
  columns: the pieces put together equal the one-rank layer's weight with ``torch.equal``.
- **The outputs are the one-rank outputs.** Column-parallel outputs concatenated (per projection),
  and each row-parallel rank's all-reduced output, equal the one-rank output within float32
  rounding (``assert_outputs_close``: rtol 1e-5, atol 1e-5 of the largest output, since a sum's
  rounding error scales with its terms, not with its result). It is not 0 because the weights
  are equal but the sums are not done in the same order: a row-parallel rank sums its inputs'
  products, then the all-reduce adds the ranks' partial sums, where one rank adds all products in
  the BLAS's own blocking; and a matmul of fewer outputs may block its reduction differently.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from pluginfer.backends.cpu import backend as cpu
from pluginfer.core.protocols import BuildContext, RankInfo
from pluginfer.core.registry import get_registry
from pluginfer.layers.context import building
from pluginfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pluginfer.testing.threads import run_ranks

WORLDS = (2, 4)
TOKENS = 5
_BUILD = threading.Lock()  # ``building`` sets one process-wide context: ranks build one at a time



@functools.cache
def backend() -> cpu.CpuBackend:
    return cpu.build()


def rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --------------------------------------------------------------------------- layers and their checkpoints


@dataclass
class Case:
    """One layer kind: how to build it, its checkpoint tensors and where each projection's rows go."""

    kind: str  # column, merged, qkv, row
    make: Callable[[], torch.nn.Module]
    tensors: list[tuple[str, object, object]]  # (parameter, full checkpoint tensor, shard id)
    input_size: int  # full inputs
    projections: list[int] = field(default_factory=list)  # full rows of each projection (column kinds)
    kv_heads: int = 0  # qkv: the checkpoint's KV heads; projections 1 and 2 are split by head


def rank_rows(case: Case, index: int, rank: int, world: int) -> slice:
    """The checkpoint rows of projection ``index`` that ``rank`` holds (written out here, not taken from the layer)."""
    full = case.projections[index]
    if case.kind == "qkv" and index > 0 and case.kv_heads < world:
        head = full // case.kv_heads
        kv = rank // (world // case.kv_heads)  # consecutive ranks share one KV head
        return slice(kv * head, (kv + 1) * head)
    part = full // world
    return slice(rank * part, (rank + 1) * part)


def linear_tensors(weights: dict[str, torch.Tensor], shard_ids: dict[str, object],
                   biases: dict[str, torch.Tensor] | None = None) -> list[tuple[str, object, object]]:
    """(param, tensor, shard id) for a float/GGUF ``weight`` (and ``bias``) per projection."""
    out = [("weight", tensor, shard_ids[name]) for name, tensor in weights.items()]
    return out + [("bias", tensor, shard_ids[name]) for name, tensor in (biases or {}).items()]


def float_cases(hidden: int, row_inputs: int, to_weight: Callable[[torch.Tensor], object], seed: int,
                qkv: tuple[int, int, int] = (8, 2, 16), out: int = 128) -> dict[str, Case]:
    """Column, merged gate/up, QKV (GQA and one KV head, with bias) and row (with bias) layers of random weights.

    ``to_weight``: a ``[out, in]`` float weight to the checkpoint tensor (itself, or a ``GGMLTensor``).
    Weights are scaled by ``1 / sqrt(in)`` so every output is of order 1.
    """
    def w(rows: int, cols: int, s: int) -> object:
        return to_weight(rand(rows, cols, seed=seed + s, scale=cols ** -0.5))

    heads, kv_heads, head_dim = qkv
    cases = {
        "column": Case("column", lambda: ColumnParallelLinear(hidden, out), linear_tensors({"w": w(out, hidden, 1)},
                       {"w": None}), hidden, [out]),
        "merged": Case("merged", lambda: MergedColumnParallelLinear(hidden, [out, out]),
                       linear_tensors({"up": w(out, hidden, 3), "gate": w(out, hidden, 2)}, {"gate": 0, "up": 1}),
                       hidden, [out, out]),
        "row": Case("row", lambda: RowParallelLinear(row_inputs, 64, bias=True),
                    linear_tensors({"w": w(64, row_inputs, 4)}, {"w": None}, {"w": rand(64, seed=seed + 5)}),
                    row_inputs),
    }
    for name, kv in (("qkv-gqa", kv_heads), ("qkv-one-kv-head", 1)):
        sizes = [heads * head_dim, kv * head_dim, kv * head_dim]
        weights = {p: w(size, hidden, 6 + i) for i, (p, size) in enumerate(zip("vqk", [sizes[2], *sizes[:2]]))}
        biases = {p: rand(size, seed=seed + 9 + i) for i, (p, size) in enumerate(zip("qkv", sizes))}
        cases[name] = Case("qkv", functools.partial(QKVParallelLinear, hidden, head_dim, heads, kv, bias=True),
                           linear_tensors(weights, {p: p for p in "qkv"}, biases), hidden, sizes, kv)
    return cases


# --------------------------------------------------------------------------- running a layer on thread ranks


@dataclass
class RankResult:
    weight: torch.Tensor  # this rank's dense weight [out, in], read back exactly
    out: torch.Tensor  # this rank's forward output (all-reduced for row-parallel layers)
    layer: torch.nn.Module


def dense_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight the layer's quant method multiplies by, exactly: ``apply`` on the identity (no bias)."""
    eye = torch.eye(layer.input_size, dtype=torch.float32)
    return layer.quant_method.apply(layer, eye, None).t()


def run_layer(world: int, make_method: Callable[[], object], case: Case, x: torch.Tensor) -> list[RankResult]:
    """Build ``case`` on ``world`` thread ranks, load the full checkpoint on each, run ``x`` (row: its slice)."""
    def rank_main(collective: object) -> RankResult:
        ctx = BuildContext(backend=backend(), quant=make_method(), collective=collective, dtype=torch.float32,
                           max_model_len=64, rank=RankInfo(rank=collective.rank, world_size=world, tp_size=world))
        with _BUILD, building(ctx):
            layer = case.make()
        for name, tensor, shard_id in case.tensors:
            param = getattr(layer, name)
            param.checkpoint_name = f"layer.{name}"
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
        layer.quant_method.process_weights_after_loading(layer)
        inputs = x.chunk(world, dim=-1)[collective.rank] if case.kind == "row" else x
        return RankResult(dense_weight(layer), layer(inputs), layer)

    return run_ranks(world, rank_main)


def assert_outputs_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 sums of the same products in another order (see the module docstring)."""
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def assert_tensor_parallel_equals_one_rank(make_method: Callable[[], object], case: Case, world: int) -> None:
    x = rand(TOKENS, case.input_size, seed=1000)
    (single,) = run_layer(1, make_method, case, x)
    ranks = run_layer(world, make_method, case, x)
    if case.kind == "row":
        # Each rank holds its columns of the whole weight; every rank's reduced output is the one-rank output.
        assert torch.equal(torch.cat([r.weight for r in ranks], dim=1), single.weight)
        for r in ranks:
            assert torch.equal(r.out, ranks[0].out)  # the all-reduce gives every rank the same sum
            assert_outputs_close(r.out, single.out)
        return
    sizes = case.projections
    full_weights = single.weight.split(sizes)
    full_outs = single.out.split(sizes, dim=-1)
    for rank, r in enumerate(ranks):
        local = [rows.stop - rows.start for rows in (rank_rows(case, i, rank, world) for i in range(len(sizes)))]
        for index, (weight, out) in enumerate(zip(r.weight.split(local), r.out.split(local, dim=-1), strict=True)):
            rows = rank_rows(case, index, rank, world)
            assert torch.equal(weight, full_weights[index][rows]), (rank, index)
            assert_outputs_close(out, full_outs[index][:, rows])


def assert_split_error(make_method: Callable[[], object], case: Case, world: int, message: str) -> None:
    x = rand(TOKENS, case.input_size, seed=1000)
    with pytest.raises(ValueError, match=re.escape(message)):
        run_layer(world, make_method, case, x)


def registry_method(name: str) -> Callable[[], object]:
    return lambda: get_registry().load("quant", name)(None)
