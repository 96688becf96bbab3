"""The native GPTQ/AWQ tile dequantization (``native.grouped_dequantize``, the cpu backend's
``grouped_dequantize`` op) against its oracle, ``GroupQuantLinear.dequantize_columns``: equal bit for
bit, and so are the layer outputs and a GPTQ checkpoint's logits with and without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pluginfer import LLM
from pluginfer.backends import native
from pluginfer.quant.packing import GroupQuantLinear
from tests.checkpoints import prefill_logits, random_prompts

FIXTURES = Path(__file__).parents[1] / "quant" / "fixtures" / "gptq_awq"
IN_FEATURES, OUT_FEATURES, GROUP_SIZE = 256, 96, 32


@pytest.fixture(scope="module", autouse=True)
def native_library() -> None:
    reason = native.available()
    if reason is not None:
        pytest.skip(f"native kernels unavailable: {reason}")


def random_layer(bits: int, scale_dtype: torch.dtype, act_order: bool, seed: int = 0,
                 in_features: int = IN_FEATURES, out_features: int = OUT_FEATURES) -> tuple[GroupQuantLinear, nn.Module]:
    """A layer in the loaded layout with random words; group 0's zero points are all 0, group 1's all
    at the top of the range (15 or 255); act-order shuffles which inputs belong to which group."""
    generator = torch.Generator().manual_seed(seed)
    method = GroupQuantLinear(bits, GROUP_SIZE)
    pack, groups = method.pack, in_features // GROUP_SIZE

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31, shape, generator=generator, dtype=torch.int64).to(torch.int32)

    qzeros = words(groups, out_features // pack)
    qzeros[0], qzeros[1] = 0, -1  # every field 0; every field 2**bits - 1
    scales = (torch.randn(groups, out_features, generator=generator) * 0.02).to(scale_dtype)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(in_features) // GROUP_SIZE)[torch.randperm(in_features, generator=generator)]
        g_idx = g_idx.to(torch.int32)
    layer = nn.Module()
    method._set_layout(layer, words(in_features // pack, out_features), qzeros, scales, g_idx)
    return method, layer


CASES = [(bits, scale_dtype, act_order) for bits in (4, 8) for scale_dtype in (torch.float16, torch.bfloat16)
         for act_order in (False, True)]


def case_id(case: tuple) -> str:
    bits, scale_dtype, act_order = case
    return f"b{bits}-{str(scale_dtype).removeprefix('torch.')}-{'act' if act_order else 'groups'}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tile_is_bit_exact_with_the_torch_path(case: tuple) -> None:
    bits, scale_dtype, act_order = case
    method, layer = random_layer(bits, scale_dtype, act_order)
    g_idx = getattr(layer, "g_idx", None)
    for start, stop in ((0, OUT_FEATURES), (8, 48), (88, 96)):
        expected = method.dequantize_columns(layer, start, stop, torch.float32)
        ours = native.grouped_dequantize(layer.qweight, layer.qzeros, layer.scales, g_idx, bits, start, stop)
        assert torch.equal(ours.t(), expected)
        assert torch.equal(ours.t().view(torch.int32), expected.view(torch.int32))  # -0.0 too


def test_large_tile_on_openmp_threads_and_into_a_buffer() -> None:
    method, layer = random_layer(4, torch.float16, True, in_features=1024, out_features=512)
    buffer = torch.full((600 * 1024,), float("nan"))
    ours = native.grouped_dequantize(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, 4, 0, 512, buffer)
    assert ours.data_ptr() == buffer.data_ptr()
    assert torch.equal(ours.t(), method.dequantize_columns(layer, 0, 512, torch.float32))


def test_declined_inputs_return_none() -> None:
    _, layer = random_layer(4, torch.float16, False)
    qweight, qzeros, scales = layer.qweight, layer.qzeros, layer.scales
    assert native.grouped_dequantize(qweight, qzeros, scales, None, 3, 0, 8) is None  # bits
    assert native.grouped_dequantize(qweight, qzeros, scales.double(), None, 4, 0, 8) is None  # scale dtype
    assert native.grouped_dequantize(qweight, qzeros, scales.t().contiguous().t(), None, 4, 0, 8) is None
    assert native.grouped_dequantize(qweight, qzeros, scales, None, 4, 4, 12) is None  # not whole words
    with pytest.raises(ValueError, match="contiguous float32 out"):
        native.grouped_dequantize(qweight, qzeros, scales, None, 4, 0, 8, torch.empty(10))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_layer_output_with_the_kernel_equals_the_torch_path(case: tuple, dtype: torch.dtype) -> None:
    bits, scale_dtype, act_order = case
    method, layer = random_layer(bits, scale_dtype, act_order, seed=1)
    x = torch.randn(5, IN_FEATURES, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(OUT_FEATURES).to(dtype)
    layer.grouped_dequantize = None
    expected = method.apply(layer, x, bias)
    layer.grouped_dequantize = native.grouped_dequantize
    assert torch.equal(method.apply(layer, x, bias), expected)


def gptq_logits(name: str, prompt: list[int]) -> tuple[torch.Tensor, set]:
    llm = LLM(model=str(FIXTURES / name), dtype="float32", num_blocks=64, block_size=8)
    layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "qweight")]
    assert layers
    return prefill_logits(llm, prompt), {m.grouped_dequantize for m in layers}


@pytest.mark.parametrize("name", ["gptq_b4_g32_act_asym", "awq_b4_g128"])
def test_checkpoint_logits_with_and_without_the_native_dequantization(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = random_prompts(200, [24], seed=5)[0]
    logits, kernels = gptq_logits(name, prompt)
    assert kernels == {native.grouped_dequantize}
    # The same native backend without this one op: identical logits (the tiles are the same bits).
    monkeypatch.delitem(native.OPS, "grouped_dequantize")
    without_op, kernels = gptq_logits(name, prompt)
    assert kernels == {None}
    assert torch.equal(logits, without_op)
