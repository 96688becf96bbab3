"""Tensor parallelism for every quant method: the same layer on 2 and 4 thread ranks equals it on one.

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

Formats: ``none``, ``int8``, ``int4`` and the in-situ GGML types (random float weights); the
``gguf`` method on GGML tensors of every supported type (quantized by ``ggml_quantize`` or, for
Q2_K/Q3_K/Q5_K which it cannot write, random blocks with sane fp16 scales), mixed types in one
fused layer too; ``gptq``/``awq`` (GPTQModel's fixture checkpoints: 4/8 bits, groups
32/64/128/-1, act-order) and ``marlin`` (repacked from GPTQ/AWQ, and a Marlin-format checkpoint).
A split the format cannot make is a ``ValueError`` naming ``parallel.tensor_parallel_size``, both
sizes and the block or group.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pluginfer.backends import cpu
from pluginfer.core.gguf_checkpoint import GGMLTensor
from pluginfer.core.protocols import BuildContext, RankInfo
from pluginfer.core.registry import get_registry
from pluginfer.layers.context import building
from pluginfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pluginfer.quant import awq, ggml_quantize, gptq, marlin
from pluginfer.quant import marlin_layout as layout
from pluginfer.testing.threads import run_ranks
from tests.quant.test_awq import AWQ_FIXTURES
from tests.quant.test_gptq import GPTQ_FIXTURES, checkpoint_tensors, quant_config
from tests.quant.test_marlin import quantize_rtn

T = GGMLQuantizationType
WORLDS = (2, 4)
TOKENS = 5
_BUILD = threading.Lock()  # ``building`` sets one process-wide context: ranks build one at a time


@pytest.fixture(autouse=True, scope="module")
def one_thread_per_rank() -> Iterator[None]:
    """The thread ranks share torch's intra-op pool; one thread each keeps them from fighting over it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def float32_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dense_weight`` reads a layer's weight back exactly by multiplying the identity (``input_size`` rows):
    float32 tiles and the float32 tiles' row limit for the fused kernel, as every rank count must see the
    same path. bfloat16 tiles (an AMX-BF16 CPU, docs/quantization.md) round the product, and with them
    the 4-rank row layer's 256 identity rows would take the fused kernel while one rank's 1024 take tiles."""
    monkeypatch.setenv("PLUGINFER_QUANT_TILES", "float32")


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


# --------------------------------------------------------------------------- in-situ methods

# name: the block its inputs are quantized in (None: any split).
IN_SITU = {"none": None, "int8": None, "int4": ("int4 group", 128), "q8_0": ("Q8_0 block", 32),
           "q4_0": ("Q4_0 block", 32), "q4_1": ("Q4_1 block", 32), "q5_0": ("Q5_0 block", 32),
           "q5_1": ("Q5_1 block", 32), "q4_k": ("Q4_K block", 256), "q6_k": ("Q6_K block", 256)}


@functools.cache
def in_situ_cases() -> dict[str, Case]:
    # 256 inputs hold whole K-quant blocks; the row layer's 1024 inputs split into 256 per rank at 4 ranks.
    return float_cases(256, 1024, lambda w: w, seed=0)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["column", "merged", "qkv-gqa", "qkv-one-kv-head", "row"])
@pytest.mark.parametrize("method", list(IN_SITU))
def test_in_situ_methods(method: str, kind: str, world: int) -> None:
    assert_tensor_parallel_equals_one_rank(registry_method(method), in_situ_cases()[kind], world)


@pytest.mark.parametrize("method", [m for m, block in IN_SITU.items() if block])
def test_in_situ_row_split_inside_a_block_is_refused_at_build(method: str) -> None:
    name, size = IN_SITU[method]
    inputs = 2 * size  # a whole number of blocks on one rank, half a block on each of 4
    case = Case("row", lambda: RowParallelLinear(inputs, 16), [], inputs)
    assert_split_error(registry_method(method), case, 4,
                       f"parallel.tensor_parallel_size 4 splits a layer's {inputs} inputs into {size // 2}-input "
                       f"shards, not a multiple of the {name} of {size} inputs")


def test_int8_row_split_keeps_the_whole_rows_scale() -> None:
    """A row-parallel int8 rank's scale is max|row| / 127 of the whole row, not of its slice."""
    case = in_situ_cases()["row"]
    (single,) = run_layer(1, registry_method("int8"), case, rand(TOKENS, 1024, seed=1))
    for r in run_layer(2, registry_method("int8"), case, rand(TOKENS, 1024, seed=1)):
        assert torch.equal(r.layer.weight_scale, single.layer.weight_scale)
        assert r.layer.int8_row_absmax is None  # freed after quantizing


# --------------------------------------------------------------------------- gguf: GGML tensors of every type

GGUF_TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of the fp16 scale fields in a block of the types ggml_quantize cannot write (llama.cpp's structs).
F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q5_K: (0, 2)}


def to_ggml(weight: torch.Tensor, qtype: GGMLQuantizationType) -> object:
    """The checkpoint tensor a .gguf file of ``qtype`` holds for ``weight`` (float types: a plain tensor)."""
    if qtype == T.F32:
        return weight
    if qtype == T.F16:
        return weight.half()
    if qtype not in F16_FIELDS:
        raw = ggml_quantize.quantize(weight, qtype)
    else:  # random codes; fp16 scales small enough that dequantized values are finite and of order 1
        block, size = GGML_QUANT_SIZES[qtype]
        rows, blocks = weight.shape[0], weight.shape[1] // block
        generator = torch.Generator().manual_seed(weight.shape[0] * 7 + int(qtype))
        raw = torch.randint(0, 256, (rows, blocks, size), dtype=torch.uint8, generator=generator)
        for offset in F16_FIELDS[qtype]:
            scales = (torch.rand(rows, blocks, generator=generator) * 0.01).half()
            raw[..., offset:offset + 2] = scales.unsqueeze(-1).view(torch.uint8)
        raw = raw.reshape(rows, blocks * size)
    return GGMLTensor(raw, qtype, weight.shape, "blk.0.test.weight")


@functools.cache
def gguf_cases(qtype_name: str) -> dict[str, Case]:
    qtype = T[qtype_name]
    return float_cases(256, 1024, lambda w: to_ggml(w, qtype), seed=0)


def gguf_method() -> object:
    return get_registry().load("quant", "gguf")({"quant_method": "gguf"})


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["column", "merged", "qkv-gqa", "qkv-one-kv-head", "row"])
@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_gguf_every_type(qtype: str, kind: str, world: int) -> None:
    assert_tensor_parallel_equals_one_rank(gguf_method, gguf_cases(qtype)[kind], world)


@pytest.mark.parametrize("world", WORLDS)
def test_gguf_fused_layers_of_mixed_types(world: int) -> None:
    """Q4_K q/k with a Q6_K v, a Q4_K gate with a Q8_0 up: each projection is split in its own type."""
    types = {"q": T.Q4_K, "k": T.Q4_K, "v": T.Q6_K, 0: T.Q4_K, 1: T.Q8_0}
    for kind in ("qkv-gqa", "merged"):
        plain = in_situ_cases()[kind]
        tensors = [(param, to_ggml(t, types[shard]) if param == "weight" else t, shard)
                   for param, t, shard in plain.tensors]
        case = Case(plain.kind, plain.make, tensors, plain.input_size, plain.projections, plain.kv_heads)
        assert_tensor_parallel_equals_one_rank(gguf_method, case, world)


@pytest.mark.parametrize("world", WORLDS)
def test_gguf_already_fused_tensor(world: int) -> None:
    """A fused gate/up tensor in one GGML tensor: each rank takes its rows of each projection."""
    gate, up = (rand(128, 256, seed=s, scale=1 / 16) for s in (50, 51))
    case = Case("merged", lambda: MergedColumnParallelLinear(256, [128, 128]),
                [("weight", to_ggml(torch.cat([gate, up]), T.Q4_K), None)], 256, [128, 128])
    assert_tensor_parallel_equals_one_rank(gguf_method, case, world)


@pytest.mark.parametrize(("qtype", "block"), [("Q8_0", 32), ("Q4_K", 256), ("Q6_K", 256), ("Q2_K", 256)])
def test_gguf_row_split_inside_a_block_is_refused_at_load(qtype: str, block: int) -> None:
    inputs = 2 * block
    weight = to_ggml(rand(16, inputs, seed=60), T[qtype])
    case = Case("row", lambda: RowParallelLinear(inputs, 16), [("weight", weight, None)], inputs)
    assert_split_error(gguf_method, case, 4,
                       f"layer.weight: parallel.tensor_parallel_size 4 splits a layer's {inputs} inputs into "
                       f"{block // 2}-input shards, not a multiple of the {qtype} block of {block} inputs")


def test_gguf_wrong_full_shape_is_named_on_every_rank() -> None:
    """Each rank sees the whole checkpoint tensor, so a wrong size along the split axis is caught too."""
    weight = to_ggml(rand(128, 256, seed=61), T.Q8_0)
    case = Case("column", lambda: ColumnParallelLinear(256, 96), [("weight", weight, None)], 256, [96])
    assert_split_error(gguf_method, case, 2, "layer.weight: checkpoint shape (128, 256) does not match expected "
                                             "(96, 256)")


# --------------------------------------------------------------------------- gptq, awq, marlin checkpoints

PREFIX = "model.layers.0."
# The fixture llama: hidden 128, intermediate 256, 4 heads of 32, 2 KV heads.
GROUP_KINDS = {
    "column": ("column", lambda: ColumnParallelLinear(128, 256), {"mlp.gate_proj": None}, 128, [256]),
    "merged": ("merged", lambda: MergedColumnParallelLinear(128, [256, 256]), {"mlp.up_proj": 1, "mlp.gate_proj": 0},
               128, [256, 256]),
    "qkv": ("qkv", lambda: QKVParallelLinear(128, 32, 4, 2),
            {"self_attn.k_proj": "k", "self_attn.q_proj": "q", "self_attn.v_proj": "v"}, 128, [128, 64, 64]),
    "row-o": ("row", lambda: RowParallelLinear(128, 128), {"self_attn.o_proj": None}, 128, []),
    "row-down": ("row", lambda: RowParallelLinear(256, 128), {"mlp.down_proj": None}, 256, []),
}


def group_case(fixture: str, kind: str, suffixes: tuple[str, ...]) -> Case:
    layer_kind, make, projections, inputs, sizes = GROUP_KINDS[kind]
    tensors = checkpoint_tensors(fixture)
    loads = [(suffix, tensors[f"{PREFIX}{name}.{suffix}"], shard)
             for name, shard in projections.items() for suffix in suffixes]
    return Case(layer_kind, make, loads, inputs, sizes, kv_heads=2)


def group_error(group: int, kind: str, world: int) -> str | None:
    """The refusal expected when a row-parallel rank's inputs do not hold whole groups (None: it splits)."""
    inputs = GROUP_KINDS[kind][3]
    if GROUP_KINDS[kind][0] != "row" or group == -1 or (inputs // world) % group == 0:
        return None
    return (f"parallel.tensor_parallel_size {world} splits a layer's {inputs} inputs into {inputs // world}-input "
            f"shards, not a multiple of quantization_config.group_size {group}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", list(GROUP_KINDS))
@pytest.mark.parametrize("fixture", GPTQ_FIXTURES)
def test_gptq(fixture: str, kind: str, world: int) -> None:
    config = quant_config(fixture)
    case = group_case(fixture, kind, ("qweight", "qzeros", "scales", "g_idx"))
    # Act-order with groups keeps every group on every rank: its row split needs whole int32 words only.
    message = None if config["desc_act"] else group_error(config["group_size"], kind, world)
    if message:
        assert_split_error(lambda: gptq.build(config), case, world, message)
    else:
        assert_tensor_parallel_equals_one_rank(lambda: gptq.build(config), case, world)


def test_gptq_act_order_fixtures_have_unsorted_g_idx() -> None:
    """So the act-order cases above do exercise g_idx sending rows to groups held on no single rank."""
    for fixture in GPTQ_FIXTURES:
        config = quant_config(fixture)
        if config["desc_act"] and config["group_size"] != -1:
            g_idx = checkpoint_tensors(fixture)[f"{PREFIX}mlp.down_proj.g_idx"]
            assert not torch.equal(g_idx, g_idx.sort().values), fixture
            assert len(set(g_idx[:64].tolist())) == 256 // config["group_size"], fixture  # a quarter sees every group


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", list(GROUP_KINDS))
@pytest.mark.parametrize("fixture", AWQ_FIXTURES)
def test_awq(fixture: str, kind: str, world: int) -> None:
    config = quant_config(fixture)
    case = group_case(fixture, kind, ("qweight", "qzeros", "scales"))
    message = group_error(config["group_size"], kind, world)
    if message:
        assert_split_error(lambda: awq.build(config), case, world, message)
    else:
        assert_tensor_parallel_equals_one_rank(lambda: awq.build(config), case, world)


MARLIN_SOURCES = {"gptq_b4_g128_sym": ("qweight", "qzeros", "scales", "g_idx"),
                  "awq_b4_g128": ("qweight", "qzeros", "scales")}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", list(GROUP_KINDS))
@pytest.mark.parametrize("fixture", list(MARLIN_SOURCES))
def test_marlin_from_gptq_and_awq(fixture: str, kind: str, world: int) -> None:
    config = quant_config(fixture)
    case = group_case(fixture, kind, MARLIN_SOURCES[fixture])
    message = group_error(128, kind, world)
    if kind == "qkv" and world == 4:  # 32 + 32 + 32 outputs per rank
        message = ("parallel.tensor_parallel_size 4 gives each rank 96 outputs of a layer of 256, "
                   "not a multiple of Marlin's runs of 64 outputs")
    if message:
        assert_split_error(lambda: marlin.build(config), case, world, message)
    else:
        assert_tensor_parallel_equals_one_rank(lambda: marlin.build(config), case, world)


MARLIN_CONFIG = {"quant_method": "gptq", "checkpoint_format": "marlin", "bits": 4, "group_size": 128, "sym": True,
                 "desc_act": False}


@functools.cache
def marlin_checkpoint_cases() -> dict[str, Case]:
    """Marlin-format tensors (``B``, ``s``) of random weights; every rank's projection rows are whole 64-output runs."""
    def to_marlin(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scales = quantize_rtn(weight, 128)
        packed, permuted = layout.pack(codes, scales, 128)
        return {"B": packed, "s": permuted}

    cases = float_cases(256, 512, to_marlin, seed=100, qkv=(4, 2, 64), out=256)
    for case in cases.values():  # each float weight became a dict of B and s
        case.tensors = [(name, tensors[name], shard) for param, tensors, shard in case.tensors if param == "weight"
                        for name in ("B", "s")] + [t for t in case.tensors if t[0] == "bias"]
    return cases


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["column", "merged", "qkv-gqa", "qkv-one-kv-head", "row"])
def test_marlin_checkpoint(kind: str, world: int) -> None:
    assert_tensor_parallel_equals_one_rank(lambda: marlin.build(MARLIN_CONFIG), marlin_checkpoint_cases()[kind], world)


def test_marlin_checkpoint_projection_cut_inside_a_run_is_refused() -> None:
    """192 outputs over 2 ranks would cut Marlin's 64-output permutation in two (the layer's 128 per rank would not)."""
    case = Case("merged", lambda: MergedColumnParallelLinear(256, [192, 64]), [], 256, [192, 64])
    assert_split_error(lambda: marlin.build(MARLIN_CONFIG), case, 2,
                       "parallel.tensor_parallel_size 2 gives each rank 96 outputs of a 192-output projection, "
                       "not a multiple of Marlin's runs of 64 outputs")


def test_group_quant_column_split_inside_a_word_is_refused() -> None:
    config = quant_config("gptq_b4_g128_sym")
    case = Case("column", lambda: ColumnParallelLinear(128, 24), [], 128, [24])
    assert_split_error(lambda: gptq.build(config), case, 2,
                       "parallel.tensor_parallel_size 2 splits a layer's 24 outputs into 12-output shards, "
                       "not a multiple of the 8 4-bit outputs of a packed int32 word")
