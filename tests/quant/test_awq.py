"""AWQ GEMM checkpoints made by GPTQModel against its own dequantization and against transformers
running those dequantized weights (fixtures and helpers: test_gptq.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pluginfer import LLM
from pluginfer.backends.cpu import backend as cpu
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.context import building
from pluginfer.layers.linear import QKVParallelLinear, RowParallelLinear
from pluginfer.quant import awq
from pluginfer.quant.awq import dequantize_awq
from pluginfer.quant.packing import dequantize_grouped, unpack_int32
from tests.layers.test_linear import FakeRank
from tests.quant.test_gptq import (
    FIXTURES,
    assert_compact,
    assert_engine_matches_oracle,
    assert_engine_matches_transformers,
    checkpoint_tensors,
    copy_with_quant_config,
    oracle_weights,
    quant_config,
)

AWQ_FIXTURES = sorted(p.name for p in FIXTURES.glob("awq_*"))


def test_fixtures_cover_the_awq_variants() -> None:
    configs = [quant_config(name) for name in AWQ_FIXTURES]
    assert len({c["group_size"] for c in configs}) >= 2
    assert all(c["bits"] == 4 and c["zero_point"] and c["version"] == "gemm" for c in configs)


def _dequantize(name: str, prefix: str, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    tensors = checkpoint_tensors(name)
    return dequantize_awq(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"],
                          quant_config(name)["group_size"], dtype=dtype)


@pytest.mark.parametrize("name", AWQ_FIXTURES)
def test_dequantize_awq_equals_gptqmodel(name: str) -> None:
    for key, expected in oracle_weights(name).items():
        assert torch.equal(_dequantize(name, key.removesuffix(".weight")), expected), key


def test_nibble_order_matters() -> None:
    """Read in plain order, the same words give other weights: the fixtures do exercise AWQ's interleaving."""
    name, prefix = AWQ_FIXTURES[0], "model.layers.0.mlp.up_proj"
    tensors, group_size = checkpoint_tensors(name), quant_config(name)["group_size"]
    weights = unpack_int32(tensors[f"{prefix}.qweight"], 4, dim=1)
    zeros = unpack_int32(tensors[f"{prefix}.qzeros"], 4, dim=1)
    g_idx = torch.arange(weights.shape[0]) // group_size
    plain = dequantize_grouped(weights, zeros, tensors[f"{prefix}.scales"], g_idx, torch.float16)
    assert not torch.equal(plain, oracle_weights(name)[f"{prefix}.weight"])


@pytest.mark.parametrize("name", AWQ_FIXTURES)
def test_loaded_awq_layers_equal_gptqmodel(name: str) -> None:
    assert_engine_matches_oracle(name)


@pytest.mark.parametrize("name", AWQ_FIXTURES)
def test_awq_llama_matches_transformers_on_oracle_weights(name: str) -> None:
    assert_engine_matches_transformers(name)


@pytest.mark.parametrize("name", AWQ_FIXTURES)
def test_awq_weights_stay_packed(name: str) -> None:
    assert_compact(name, 4)


def test_awq_fixtures_hold_zero_points_at_both_ends_of_the_range() -> None:
    for name in AWQ_FIXTURES:
        zeros = [unpack_int32(t, 4, dim=1, order=awq.AWQ_ORDER)
                 for key, t in checkpoint_tensors(name).items() if key.endswith(".qzeros")]
        assert any((z == 0).any() for z in zeros) and any((z == 15).any() for z in zeros), name


@pytest.mark.parametrize("name", AWQ_FIXTURES)
def test_tensor_parallel_shards_of_packed_tensors(name: str) -> None:
    """Rank 1 of 2: the fused qkv (qweight and qzeros packed along the split outputs) and o_proj (inputs split)."""
    config, tensors, oracle = quant_config(name), checkpoint_tensors(name), oracle_weights(name)
    method = awq.build(config)
    ctx = BuildContext(backend=cpu.build(), quant=method, collective=FakeRank(1, 2), dtype=torch.float32,
                       max_model_len=64)
    prefix = "model.layers.0.self_attn"
    with building(ctx):
        layers = {"qkv": QKVParallelLinear(128, 32, 4, 2)}
        if 64 % config["group_size"]:  # o_proj's 64 inputs per rank cannot hold whole groups
            with pytest.raises(ValueError, match=rf"parallel.tensor_parallel_size 2 splits a layer's 128 inputs into "
                                                 rf"64-input shards, not a multiple of quantization_config.group_size "
                                                 rf"{config['group_size']}"):
                RowParallelLinear(128, 128)
        else:
            layers["o_proj"] = RowParallelLinear(128, 128)
    for suffix in ("qweight", "qzeros", "scales"):
        for shard in ("q", "k", "v"):
            param = getattr(layers["qkv"], suffix)
            param.weight_loader(param, tensors[f"{prefix}.{shard}_proj.{suffix}"], shard)
        if "o_proj" in layers:
            param = getattr(layers["o_proj"], suffix)
            param.weight_loader(param, tensors[f"{prefix}.o_proj.{suffix}"])
    for layer in layers.values():
        method.process_weights_after_loading(layer)
    qkv = layers["qkv"]
    expected_qkv = torch.cat([oracle[f"{prefix}.q_proj.weight"][64:], oracle[f"{prefix}.k_proj.weight"][32:],
                              oracle[f"{prefix}.v_proj.weight"][32:]])
    assert torch.equal(method.dequantize_columns(qkv, 0, qkv.output_size, torch.float32).half(), expected_qkv)
    if "o_proj" in layers:
        assert torch.equal(method.dequantize_columns(layers["o_proj"], 0, 128, torch.float32).half(),
                           oracle[f"{prefix}.o_proj.weight"][:, 64:])


@pytest.mark.parametrize(("changes", "field"), [
    ({"bits": 8}, "bits: unsupported value 8"),
    ({"bits": 3}, "bits: unsupported value 3"),
    ({"version": "gemv"}, "version: unsupported value 'gemv'"),
    ({"version": "gemv_fast"}, "version: unsupported value 'gemv_fast'"),
    ({"zero_point": False}, "zero_point: unsupported value False"),
    ({"group_size": -1}, "group_size: unsupported value -1"),
    ({"modules_to_not_convert": ["mlp.down_proj"]}, "modules_to_not_convert: unsupported value"),
    ({"quant_method": "gptq"}, "quant_method: 'gptq'"),
])
def test_unsupported_awq_configs_name_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        awq.build({**quant_config(AWQ_FIXTURES[0]), **changes})


def test_unsupported_awq_config_fails_at_load(tmp_path: Path) -> None:
    path = copy_with_quant_config(AWQ_FIXTURES[0], tmp_path, {"version": "gemv"})
    with pytest.raises(ValueError, match="quantization_config.version: unsupported value 'gemv'"):
        LLM(model=str(path), dtype="float32", num_blocks=16, block_size=8)
