"""Tensor parallelism of the group-quantized checkpoints: ``gptq`` and ``awq`` (GPTQModel's fixture
checkpoints: 4/8 bits, groups 32/64/128/-1, act-order) and ``marlin`` (repacked from GPTQ/AWQ, and a
Marlin-format checkpoint): the same layer on 2 and 4 thread ranks equals it on one (how:
``tensor_parallel_harness.py``). A split the format cannot make is a ``ValueError`` naming
``parallel.tensor_parallel_size``, both sizes and the group.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pluginfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pluginfer.quant import awq, gptq, marlin
from pluginfer.quant import marlin_layout as layout
from tests.quant.tensor_parallel_harness import (
    WORLDS,
    Case,
    assert_split_error,
    assert_tensor_parallel_equals_one_rank,
    float_cases,
)
from tests.quant.test_awq import AWQ_FIXTURES
from tests.quant.test_gptq import GPTQ_FIXTURES, checkpoint_tensors, quant_config
from tests.quant.test_marlin import quantize_rtn

pytestmark = pytest.mark.usefixtures("one_thread_per_rank", "float32_tiles")


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
