"""GPTQ checkpoints made by GPTQModel (tests/quant/fixtures/make_gptq_awq.py) against GPTQModel's own
dequantization and against transformers running those dequantized weights.

The helpers here (fixture loading, the transformers reference, bytes per weight) serve test_awq.py too.
"""

from __future__ import annotations

import functools
import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file

from pluginfer import LLM
from pluginfer.backends.cpu import backend as cpu
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.context import building
from pluginfer.layers.linear import QKVParallelLinear, RowParallelLinear
from pluginfer.quant import gptq
from pluginfer.quant.gptq import dequantize_gptq, unpack_gptq, v1_to_v2_zeros
from pluginfer.quant.packing import AWQ_ORDER, pack_int32, unpack_int32
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts
from tests.layers.test_linear import FakeRank

FIXTURES = Path(__file__).parent / "fixtures" / "gptq_awq"
GPTQ_FIXTURES = sorted(p.name for p in FIXTURES.glob("gptq_*"))
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
# Our fused layers and the checkpoint projections they hold, in order along the outputs.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}


def quant_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]


@functools.cache
def oracle_weights(name: str) -> dict[str, torch.Tensor]:
    """GPTQModel's own dequantized float16 ``[out, in]`` weight of every linear layer."""
    return load(gzip.decompress((FIXTURES / name / "oracle.safetensors.gz").read_bytes()))


@functools.cache
def checkpoint_tensors(name: str) -> dict[str, torch.Tensor]:
    """The checkpoint's own tensors: the quantized ones (and AWQ's rescaled norms)."""
    return load_file(str(FIXTURES / name / "quantized.safetensors"))


@functools.cache
def engine(name: str) -> LLM:
    return LLM(model=str(FIXTURES / name), dtype="float32", num_blocks=64, block_size=8)


@functools.cache
def transformers_reference(name: str) -> torch.nn.Module:
    """transformers' llama in float32 holding the oracle's dequantized weights and the checkpoint's other tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((FIXTURES / "base" / "config.json").read_text())
    config.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(config)).float().eval()
    own = {k: v for k, v in checkpoint_tensors(name).items() if not k.endswith(QUANTIZED_SUFFIXES)}
    state = {**load_file(str(FIXTURES / "base" / "base.safetensors")), **own, **oracle_weights(name)}
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model


def quantized_layers(llm: LLM) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in llm.engine.executor.pipeline.named_modules()
            if hasattr(module, "quant_method")}


def engine_dense_weights(llm: LLM) -> dict[str, torch.Tensor]:
    """Each checkpoint projection's ``[out, in]`` weight, as our loaded layers dequantize it (float32)."""
    weights = {}
    for name, layer in quantized_layers(llm).items():  # e.g. model.layers.0.self_attn.qkv_proj
        dense = layer.quant_method.dequantize_columns(layer, 0, layer.output_size, torch.float32)
        layer_prefix, block, fused = name.rsplit(".", 2)
        sizes = getattr(layer, "output_sizes", [layer.output_size])
        for part, weight in zip(FUSED[f"{block}.{fused}"], dense.split(sizes), strict=True):
            weights[f"{layer_prefix}.{part}.weight"] = weight
    return weights


def assert_engine_matches_oracle(name: str) -> None:
    """Our float32 weights are the exact products ``(q - z) * s``; GPTQModel rounds them to float16 once."""
    oracle = oracle_weights(name)
    ours = engine_dense_weights(engine(name))
    assert ours.keys() == oracle.keys()
    for key, weight in oracle.items():
        assert torch.equal(ours[key].half(), weight), key
        # The float32 value is exact: it lies within half a float16 step of the oracle's.
        assert ((ours[key] - weight.float()).abs() <= weight.float().abs() * 2.0**-11 + 2.0**-25).all(), key


PROMPTS = random_prompts(512, [7, 19], seed=11)


def assert_engine_matches_transformers(name: str) -> None:
    """Greedy tokens equal transformers' on the oracle's weights; logprobs close to it, and to the exact weights."""
    llm, reference = engine(name), transformers_reference(name)
    exact = transformers_reference.__wrapped__(name)  # the same model holding our float32 weights
    exact.load_state_dict({**exact.state_dict(), **engine_dense_weights(llm)}, strict=True)
    for prompt in PROMPTS:
        logprobs = prefill_logits(llm, prompt).log_softmax(-1)  # first: generate would cache the prompt's blocks
        # Same weights, transformers' dense forward against our tiled one on packed codes: float32 summation
        # order only (measured worst 1.5e-5 over all fixtures).
        torch.testing.assert_close(logprobs, hf_logits(exact, prompt).log_softmax(-1), atol=1e-4, rtol=0)
        # The oracle's float16 weights are ours rounded once (<= 2**-11 relative each, proven exactly by
        # assert_engine_matches_oracle). This llama's large random weights (initializer_range 0.2) make logits
        # sharp (logprob spread ~2.4 nats) and amplify that rounding to at most 0.035 nats (measured over all
        # fixtures); 0.06 leaves margin, while a wrong group, zero point or nibble order moves them by whole nats.
        torch.testing.assert_close(logprobs, hf_logits(reference, prompt).log_softmax(-1), atol=0.06, rtol=0)
        ours = list(llm.generate([prompt], greedy(12))[0].outputs[0].token_ids)
        assert ours == hf_greedy(exact, prompt, 12), f"{name}: greedy tokens differ for {prompt}"
        # On the oracle's rounded weights transformers picks the same tokens except where two candidates lie
        # within that rounding's reach (0.06 nats, as above): check our choices along our own continuation.
        forced = hf_logits(reference, prompt + ours).log_softmax(-1)[len(prompt) - 1:-1]
        chosen = forced.gather(-1, torch.tensor(ours)[:, None])[:, 0]
        assert (forced.max(-1).values - chosen <= 0.06).all(), f"{name}: a token the oracle's model ranks far lower"


def bytes_per_weight(llm: LLM) -> float:
    """Resident bytes of the linear layers' own parameters (biases aside) per weight they stand for."""
    layers = quantized_layers(llm).values()
    nbytes = sum(p.nbytes for m in layers for n, p in m.named_parameters(recurse=False) if n != "bias")
    return nbytes / sum(m.input_size * m.output_size for m in layers)


def assert_compact(name: str, bits: int) -> None:
    llm = engine(name)
    for layer in quantized_layers(llm).values():
        assert all(p.dtype in (torch.int32, torch.float16) for p in layer.parameters(recurse=False)), \
            "a dense float copy of a weight stayed resident"
    limit = {4: 0.6, 8: 1.1}[bits]  # 0.5 or 1 byte of packed codes, plus float16 scales, zeros and g_idx
    assert bytes_per_weight(llm) <= limit


def copy_with_quant_config(name: str, target: Path, changes: dict) -> Path:
    """A copy of a fixture (and its shared base) whose quantization_config has ``changes`` applied."""
    shutil.copytree(FIXTURES / "base", target / "base")
    shutil.copytree(FIXTURES / name, target / name)
    path = target / name / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))
    return target / name


# --- GPTQ ---


def test_fixtures_cover_the_gptq_variants() -> None:
    configs = [quant_config(name) for name in GPTQ_FIXTURES]
    assert {c["bits"] for c in configs} == {4, 8}
    assert {c["group_size"] for c in configs} == {32, 64, 128, -1}
    assert {c["desc_act"] for c in configs} == {True, False} and {c["sym"] for c in configs} == {True, False}
    assert {c["checkpoint_format"] for c in configs} == {"gptq"}


@pytest.mark.parametrize("name", GPTQ_FIXTURES)
def test_dequantize_gptq_equals_gptqmodel(name: str) -> None:
    config, tensors = quant_config(name), checkpoint_tensors(name)
    for key, expected in oracle_weights(name).items():
        prefix = key.removesuffix(".weight")
        ours = dequantize_gptq(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"],
                               tensors[f"{prefix}.g_idx"], config["bits"], dtype=torch.float16)
        assert torch.equal(ours, expected), key


@pytest.mark.parametrize("name", GPTQ_FIXTURES)
def test_loaded_gptq_layers_equal_gptqmodel(name: str) -> None:
    assert_engine_matches_oracle(name)


@pytest.mark.parametrize("name", GPTQ_FIXTURES)
def test_gptq_llama_matches_transformers_on_oracle_weights(name: str) -> None:
    assert_engine_matches_transformers(name)


@pytest.mark.parametrize("name", GPTQ_FIXTURES)
def test_gptq_weights_stay_packed(name: str) -> None:
    assert_compact(name, quant_config(name)["bits"])
    layers = quantized_layers(engine(name)).values()
    config = quant_config(name)
    # Act-order keeps its g_idx; contiguous groups (and the single group of -1) need none.
    shuffled = config["desc_act"] and config["group_size"] != -1
    assert all(hasattr(m, "g_idx") == shuffled for m in layers)


def test_asym_fixtures_hold_zero_points_at_both_ends_of_the_range() -> None:
    """The fixture rows built all-positive / all-negative give zero points 0 and 2**bits - 1."""
    for name in GPTQ_FIXTURES:
        config = quant_config(name)
        if config["sym"]:
            continue
        tensors, top = checkpoint_tensors(name), (1 << config["bits"]) - 1
        zeros = [unpack_gptq(tensors[k.replace("qzeros", "qweight")], t, tensors[k.replace("qzeros", "scales")],
                             None, config["bits"])[1] for k, t in tensors.items() if k.endswith(".qzeros")]
        assert any((z == 0).any() for z in zeros) and any((z == top).any() for z in zeros), name


def test_v1_zero_points_are_restored_per_word() -> None:
    """GPTQModel stores ``pack(zeros) - 0x11111111`` as one int32: a zero of 0 borrows from the next field.

    Adding one back per 4-bit field would turn the neighbour of a 0 into 15 (and miss the fixtures' oracle).
    """
    zeros = torch.tensor([[0, 7, 15, 0, 0, 3, 8, 15]], dtype=torch.int32)
    packed = pack_int32(zeros, 4, dim=1).to(torch.int64)
    stored = (packed - 0x11111111) & 0xFFFFFFFF
    stored = torch.where(stored >= 2**31, stored - 2**32, stored).to(torch.int32)
    assert torch.equal(unpack_int32(v1_to_v2_zeros(stored, 4), 4, dim=1), zeros)
    per_field = (unpack_int32(stored, 4, dim=1) + 1) & 15
    assert not torch.equal(per_field, zeros)


@pytest.mark.parametrize(("bits", "order"), [(4, None), (8, None), (4, AWQ_ORDER)])
def test_pack_unpack_round_trip(bits: int, order: tuple[int, ...] | None) -> None:
    values = torch.randint(0, 1 << bits, (24, 16), dtype=torch.int32)
    for dim in (0, 1):
        packed = pack_int32(values, bits, dim, order)
        assert packed.dtype == torch.int32 and packed.shape[dim] == values.shape[dim] * bits // 32
        assert torch.equal(unpack_int32(packed, bits, dim, order), values)
    if order is not None:  # slot i of each word holds value order[i]
        word = pack_int32(torch.arange(8, dtype=torch.int32)[None], 4, dim=1, order=order)
        assert [(int(word) >> (4 * i)) & 15 for i in range(8)] == list(order)


@pytest.mark.parametrize("name", ["gptq_b4_gall_asym", "gptq_b8_g32_asym", "gptq_b8_gall_act_sym"])
def test_tensor_parallel_shards_of_packed_tensors(name: str) -> None:
    """Rank 1 of 2: the fused qkv (outputs split, zeros packed along them) and o_proj (inputs split)."""
    config, tensors, oracle = quant_config(name), checkpoint_tensors(name), oracle_weights(name)
    method = gptq.build(config)
    ctx = BuildContext(backend=cpu.build(), quant=method, collective=FakeRank(1, 2), dtype=torch.float32,
                       max_model_len=64)
    with building(ctx):
        qkv = QKVParallelLinear(128, 32, 4, 2)
        o_proj = RowParallelLinear(128, 128)
    prefix = "model.layers.1.self_attn"
    for shard, part in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            param = getattr(qkv, suffix)
            param.weight_loader(param, tensors[f"{prefix}.{part}.{suffix}"], shard)
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        param = getattr(o_proj, suffix)
        param.weight_loader(param, tensors[f"{prefix}.o_proj.{suffix}"])
    for layer in (qkv, o_proj):
        method.process_weights_after_loading(layer)
    dense_qkv = method.dequantize_columns(qkv, 0, qkv.output_size, torch.float32)
    expected_qkv = torch.cat([oracle[f"{prefix}.q_proj.weight"][64:], oracle[f"{prefix}.k_proj.weight"][32:],
                              oracle[f"{prefix}.v_proj.weight"][32:]])
    assert torch.equal(dense_qkv.half(), expected_qkv)
    dense_o = method.dequantize_columns(o_proj, 0, o_proj.output_size, torch.float32)
    assert torch.equal(dense_o.half(), oracle[f"{prefix}.o_proj.weight"][:, 64:])


@pytest.mark.parametrize(("changes", "field"), [
    ({"bits": 3}, "bits: unsupported value 3"),
    ({"bits": 2}, "bits: unsupported value 2"),
    ({"group_size": 0}, "group_size: unsupported value 0"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format: unsupported value 'marlin'"),
    ({"checkpoint_format": None, "format": "bitblas"}, "format: unsupported value 'bitblas'"),
    ({"is_marlin_format": True}, "is_marlin_format: unsupported value True"),
    ({"pack_dtype": "int16"}, "pack_dtype: unsupported value 'int16'"),
    ({"lm_head": True}, "lm_head: unsupported value True"),
    ({"quant_method": "awq"}, "quant_method: 'awq'"),
])
def test_unsupported_gptq_configs_name_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        gptq.build({**quant_config(GPTQ_FIXTURES[0]), **changes})


def test_gptq_v2_checkpoints_keep_their_zero_points() -> None:
    name = next(n for n in GPTQ_FIXTURES if not quant_config(n)["sym"])
    tensors = checkpoint_tensors(name)
    prefix = "model.layers.0.mlp.down_proj"
    args = (tensors[f"{prefix}.qweight"], v1_to_v2_zeros(tensors[f"{prefix}.qzeros"], quant_config(name)["bits"]),
            tensors[f"{prefix}.scales"], tensors[f"{prefix}.g_idx"], quant_config(name)["bits"])
    assert torch.equal(dequantize_gptq(*args, checkpoint_format="gptq_v2", dtype=torch.float16),
                       oracle_weights(name)[f"{prefix}.weight"])
    assert gptq.build({**quant_config(name), "checkpoint_format": "gptq_v2"}).checkpoint_format == "gptq_v2"


def test_unsupported_config_fails_at_load(tmp_path: Path) -> None:
    path = copy_with_quant_config(GPTQ_FIXTURES[0], tmp_path, {"bits": 3})
    with pytest.raises(ValueError, match="quantization_config.bits: unsupported value 3"):
        LLM(model=str(path), dtype="float32", num_blocks=16, block_size=8)


@pytest.mark.parametrize("rank", [0, 1])
def test_act_order_row_split_keeps_every_group(rank: int) -> None:
    """Act-order with groups, inputs split: each rank keeps all groups' scales and zeros and its rows of g_idx."""
    name = "gptq_b4_g32_act_asym"
    config, tensors, oracle = quant_config(name), checkpoint_tensors(name), oracle_weights(name)
    method = gptq.build(config)
    ctx = BuildContext(backend=cpu.build(), quant=method, collective=FakeRank(rank, 2), dtype=torch.float32,
                       max_model_len=64)
    with building(ctx):
        down = RowParallelLinear(256, 128)
    prefix = "model.layers.0.mlp.down_proj"
    groups = 256 // config["group_size"]
    assert down.scales.shape == (groups, 128) and down.qzeros.shape == (groups, 128 // 8)
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        param = getattr(down, suffix)
        param.weight_loader(param, tensors[f"{prefix}.{suffix}"])
    method.process_weights_after_loading(down)
    assert torch.equal(down.g_idx, tensors[f"{prefix}.g_idx"][rank * 128:(rank + 1) * 128])
    dense = method.dequantize_columns(down, 0, 128, torch.float32)
    assert torch.equal(dense.half(), oracle[f"{prefix}.weight"][:, rank * 128:(rank + 1) * 128])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tiles_round_the_exact_weight_once(dtype: torch.dtype) -> None:
    name = "gptq_b4_g32_act_asym"
    layer = quantized_layers(engine(name))["model.layers.1.mlp.gate_up_proj"]
    oracle = oracle_weights(name)
    dense = torch.cat([oracle["model.layers.1.mlp.gate_proj.weight"], oracle["model.layers.1.mlp.up_proj.weight"]])
    tile = layer.quant_method.dequantize_columns(layer, 0, layer.output_size, dtype)
    assert tile.dtype == dtype
    if dtype == torch.float16:
        assert torch.equal(tile, dense)  # GPTQModel's own float16 product
    x = torch.randn(3, 128)
    out = layer(x.to(dtype))
    assert out.dtype == dtype
    # Inputs and weights rounded to dtype, float accumulation: a few units of dtype's precision.
    torch.testing.assert_close(out.float(), x @ dense.float().t(), atol=0.05, rtol=0.02)


def test_bfloat16_scales_are_kept_as_they_are(tmp_path: Path) -> None:
    """A checkpoint whose scales are bfloat16 loads them unrounded (float16 cannot hold every bfloat16)."""
    from safetensors.torch import save_file

    name = "gptq_b4_g32_act_asym"
    path = copy_with_quant_config(name, tmp_path, {})
    tensors = {k: v.bfloat16() if k.endswith(".scales") else v for k, v in checkpoint_tensors(name).items()}
    save_file(tensors, str(path / "quantized.safetensors"))
    llm = LLM(model=str(path), dtype="float32", num_blocks=16, block_size=8)
    layer = quantized_layers(llm)["model.layers.0.mlp.gate_up_proj"]
    assert layer.scales.dtype == torch.bfloat16
    expected = torch.cat([tensors["model.layers.0.mlp.gate_proj.scales"], tensors["model.layers.0.mlp.up_proj.scales"]],
                         dim=1)
    assert torch.equal(layer.scales, expected)


def test_fused_projections_must_share_their_g_idx() -> None:
    name = "gptq_b4_g32_act_asym"
    tensors = checkpoint_tensors(name)
    ctx = BuildContext(backend=cpu.build(), quant=gptq.build(quant_config(name)), collective=FakeRank(0, 1),
                       dtype=torch.float32, max_model_len=64)
    with building(ctx):
        qkv = QKVParallelLinear(128, 32, 4, 2)
    g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
    qkv.g_idx.weight_loader(qkv.g_idx, g_idx, "q")
    qkv.g_idx.weight_loader(qkv.g_idx, g_idx.clone(), "k")  # the same: fine
    with pytest.raises(ValueError, match="differs from the g_idx of the projections fused with it"):
        qkv.g_idx.weight_loader(qkv.g_idx, g_idx.flip(0), "v")
