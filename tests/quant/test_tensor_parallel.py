"""Tensor parallelism of the in-situ quant methods (``none``, ``int8``, ``int4``, the in-situ GGML types) and
of the ``gguf`` method on GGML tensors of every type: the same layer on 2 and 4 thread ranks equals it on one,
weights bit for bit and outputs within float32 rounding (how: ``tensor_parallel_harness.py``). GGML tensors
are quantized by ``ggml_quantize`` or, for Q2_K/Q3_K/Q5_K which it cannot write, random blocks with sane fp16
scales; mixed types in one fused layer too. A split the format cannot make is a ``ValueError`` naming
``parallel.tensor_parallel_size``, both sizes and the block.
"""

from __future__ import annotations

import functools

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pluginfer.core.registry import get_registry
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from pluginfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pluginfer.quant import ggml_quantize
from tests.quant.tensor_parallel_harness import (
    TOKENS,
    WORLDS,
    Case,
    assert_split_error,
    assert_tensor_parallel_equals_one_rank,
    float_cases,
    rand,
    registry_method,
    run_layer,
)

T = GGMLQuantizationType

pytestmark = pytest.mark.usefixtures("one_thread_per_rank", "float32_tiles")


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
