"""The native GPTQ/AWQ tile dequantization (``native_quant.grouped_dequantize``, the cpu backend's
``grouped_dequantize`` op) against its oracle, ``GroupQuantLinear.dequantize_columns``: equal bit for
bit, and so are the layer outputs and GPTQ/AWQ checkpoints' logits with and without it. Likewise the
int4 method's rows (``native_quant.int4_dequantize``) against ``int4.dequantize_int4``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pluginfer import LLM
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.quant import int4
from pluginfer.quant.packing import GroupQuantLinear
from pluginfer.quant.tiled import replace_weight
from tests.checkpoints import prefill_logits, random_prompts, save_hf_model

FIXTURES = Path(__file__).parents[1] / "quant" / "fixtures" / "gptq_awq"
IN_FEATURES, OUT_FEATURES, GROUP_SIZE = 256, 96, 32


@pytest.fixture(scope="module", autouse=True)
def needs_native_kernels() -> None:
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
        ours = native_quant.grouped_dequantize(layer.qweight, layer.qzeros, layer.scales, g_idx, bits, start, stop)
        assert torch.equal(ours.t(), expected)
        assert torch.equal(ours.t().view(torch.int32), expected.view(torch.int32))  # -0.0 too
        low = native_quant.grouped_dequantize(layer.qweight, layer.qzeros, layer.scales, g_idx, bits, start, stop,
                                              dtype=torch.bfloat16)  # the AMX GEMM's tiles: rounded to nearest even
        assert torch.equal(low.t().view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))


def test_bfloat16_rounding_of_every_kind_of_float32_value() -> None:
    """Through the grouped kernel with float32 scales (weight = (q - zero) * scale = scale for q 1, zero 0):
    ties to even both ways, carries into the exponent and to infinity, subnormals kept (not flushed),
    infinities, -0 and NaN, as ``Tensor.to(torch.bfloat16)`` rounds them (NaN: any NaN)."""
    values = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 2 - 2**-9, 3.4e38, -3.4e38,
                           1e-40, -1e-40, 2**-133, 1.5 * 2**-133, float("inf"), float("-inf"), -0.0, 0.0,
                           float("nan"), 0.1, -12345.678], dtype=torch.float32)
    values = torch.cat([values, torch.randn(6, generator=torch.Generator().manual_seed(0))])  # 24 outputs
    out_features, pack = values.numel(), 8
    layer = nn.Module()
    method = GroupQuantLinear(4, 32)
    qweight = torch.full((32 // pack, out_features), 0x11111111, dtype=torch.int32)  # every level 1
    method._set_layout(layer, qweight, torch.zeros(1, out_features // pack, dtype=torch.int32),
                       values[None].clone(), None)
    ours = native_quant.grouped_dequantize(layer.qweight, layer.qzeros, layer.scales, None, 4, 0, out_features,
                                           dtype=torch.bfloat16)
    expected = values.to(torch.bfloat16).expand(32, -1)
    nan = expected.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert ours[0, 0] == 1.0 and ours[0, 1] == 1 + 2**-6 and ours[0, 5].isinf() and ours[0, 7] != 0


def test_large_tile_on_openmp_threads_and_into_a_buffer() -> None:
    method, layer = random_layer(4, torch.float16, True, in_features=1024, out_features=512)
    buffer = torch.full((600 * 1024,), float("nan"))
    ours = native_quant.grouped_dequantize(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, 4, 0, 512, buffer)
    assert ours.data_ptr() == buffer.data_ptr()
    assert torch.equal(ours.t(), method.dequantize_columns(layer, 0, 512, torch.float32))


def test_declined_inputs_return_none() -> None:
    _, layer = random_layer(4, torch.float16, False)
    qweight, qzeros, scales = layer.qweight, layer.qzeros, layer.scales
    assert native_quant.grouped_dequantize(qweight, qzeros, scales, None, 3, 0, 8) is None  # bits
    assert native_quant.grouped_dequantize(qweight, qzeros, scales.double(), None, 4, 0, 8) is None  # scale dtype
    assert native_quant.grouped_dequantize(qweight, qzeros, scales.t().contiguous().t(), None, 4, 0, 8) is None
    assert native_quant.grouped_dequantize(qweight, qzeros, scales, None, 4, 4, 12) is None  # not whole words
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16 out"):
        native_quant.grouped_dequantize(qweight, qzeros, scales, None, 4, 0, 8, torch.empty(10))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_layer_output_with_the_kernel_equals_the_torch_path(case: tuple, dtype: torch.dtype) -> None:
    bits, scale_dtype, act_order = case
    method, layer = random_layer(bits, scale_dtype, act_order, seed=1)
    x = torch.randn(5, IN_FEATURES, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(OUT_FEATURES).to(dtype)
    layer.grouped_dequantize = None
    expected = method.apply(layer, x, bias)
    layer.grouped_dequantize = native_quant.grouped_dequantize
    assert torch.equal(method.apply(layer, x, bias), expected)


def gptq_logits(name: str, prompt: list[int]) -> tuple[torch.Tensor, set]:
    llm = LLM(model=str(FIXTURES / name), dtype="float32", num_blocks=64, block_size=8)
    layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "qweight")]
    assert layers
    return prefill_logits(llm, prompt), {m.grouped_dequantize for m in layers}


@pytest.mark.parametrize("name", ["gptq_b4_g32_act_asym", "awq_b4_g128"])
def test_checkpoint_logits_with_and_without_the_native_dequantization(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_quant.QUANT_TILES_ENV, "float32")  # the torch path's tiles (bfloat16: test_bf16_tiles.py)
    prompt = random_prompts(200, [24], seed=5)[0]
    logits, kernels = gptq_logits(name, prompt)
    assert kernels == {native_quant.grouped_dequantize}
    # The same native backend without this one op: identical logits (the tiles are the same bits).
    monkeypatch.delitem(native.NATIVE, "grouped_dequantize")
    without_op, kernels = gptq_logits(name, prompt)
    assert kernels == {None}
    assert torch.equal(logits, without_op)


def random_int4(rows: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random levels (every byte value), fp16 scales and zeros of either sign, row 0 all zero levels."""
    generator = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (rows, in_features // 2), generator=generator, dtype=torch.uint8)
    qweight[0] = 0
    shape = (rows, in_features // int4.GROUP_SIZE)
    scales = (torch.randn(shape, generator=generator) * 0.01).half()
    zeros = (torch.randn(shape, generator=generator) * 0.1).half()
    return qweight, scales, zeros


@pytest.mark.parametrize("rows", [3, 300], ids=["one-thread", "openmp"])
def test_int4_rows_are_bit_exact_with_the_torch_path(rows: int) -> None:
    qweight, scales, zeros = random_int4(rows, 512, seed=rows)
    expected = int4.dequantize_int4(qweight, scales, zeros)
    assert torch.equal(native_quant.int4_dequantize(qweight, scales, zeros).view(torch.int32), expected.view(torch.int32))
    buffer = torch.empty(rows * 512, dtype=torch.bfloat16)
    low = native_quant.int4_dequantize(qweight, scales, zeros, buffer)  # the AMX GEMM's tiles: rounded to nearest even
    assert low.data_ptr() == buffer.data_ptr()
    assert torch.equal(low.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))
    assert native_quant.int4_dequantize(qweight, scales.float(), zeros) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_layer_output_with_the_kernel_equals_the_torch_path(dtype: torch.dtype) -> None:
    method = int4.Int4Linear()
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.empty(1), requires_grad=False)
    qweight, scales, zeros = random_int4(600, 256, seed=3)  # two tiles, the second partial
    replace_weight(layer, qweight=qweight, scales=scales, zeros=zeros)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    layer.int4_dequantize = None
    expected = method.apply(layer, x, None)
    layer.int4_dequantize = native_quant.int4_dequantize
    assert torch.equal(method.apply(layer, x, None), expected)


# A small llama whose every input size is a multiple of int4's 128-input groups.
INT4_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05, rms_norm_eps=1e-5)


def int4_logits(path: Path, prompt: list[int]) -> tuple[torch.Tensor, set]:
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, quant="int4")
    layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "qweight")]
    assert layers
    return prefill_logits(llm, prompt), {m.int4_dequantize for m in layers}


def test_int4_llama_logits_with_and_without_the_native_dequantization(
        tmp_path: Path, tiny_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_hf_model("LlamaForCausalLM", INT4_LLAMA, tmp_path, tiny_tokenizer_dir)
    monkeypatch.setenv(native_quant.QUANT_TILES_ENV, "float32")  # the torch path's tiles (bfloat16: test_bf16_tiles.py)
    prompt = random_prompts(200, [24], seed=6)[0]
    logits, kernels = int4_logits(tmp_path, prompt)
    assert kernels == {native_quant.int4_dequantize}
    monkeypatch.delitem(native.NATIVE, "int4_dequantize")
    without_op, kernels = int4_logits(tmp_path, prompt)
    assert kernels == {None}
    assert torch.equal(logits, without_op)
