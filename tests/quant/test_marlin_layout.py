"""The Marlin layout against GPTQModel's tables and packers (fixture made by make_marlin_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pluginfer.quant import marlin_layout as layout

FIXTURE = Path(__file__).parent / "fixtures" / "marlin" / "gptqmodel_marlin.safetensors"


@pytest.fixture(scope="module")
def oracle() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE))


def test_permutation_tables_equal_gptqmodel(oracle):
    assert torch.equal(layout.weight_permutation(), oracle["perm"])
    assert torch.equal(layout.scale_permutation(), oracle["scale_perm"])
    assert torch.equal(layout.scale_permutation_single(), oracle["scale_perm_single"])


def test_tables_are_permutations():
    for table, size in ((layout.tile_permutation(), 1024), (layout.weight_permutation(), 1024),
                        (layout.scale_permutation(), 64), (layout.scale_permutation_single(), 32)):
        assert torch.equal(table.sort().values, torch.arange(size))


def test_interleave_is_applied_on_top_of_the_tile_permutation():
    tile = layout.tile_permutation().reshape(-1, 8)
    assert torch.equal(layout.weight_permutation().reshape(-1, 8), tile[:, [0, 2, 4, 6, 1, 3, 5, 7]])


def test_pack_equals_gptqmodel_packer(oracle):
    codes = oracle["codes"].int()
    assert torch.equal(layout.pack_weight(codes), oracle["B"])
    assert torch.equal(layout.unpack_weight(oracle["B"], *codes.shape), codes)


@pytest.mark.parametrize("group_size, name", [(128, "scales_grouped"), (-1, "scales_channel")])
def test_scale_permutation_equals_gptqmodel(oracle, group_size, name):
    size_k = oracle["codes"].shape[0]
    assert torch.equal(layout.permute_scales(oracle[name], size_k, group_size), oracle[f"{name}_marlin"])
    assert torch.equal(layout.unpermute_scales(oracle[f"{name}_marlin"], size_k, group_size), oracle[name])


def test_zero_points_equal_gptqmodel(oracle):
    size_n = oracle["zeros"].shape[1]
    assert torch.equal(layout.pack_zero_points(oracle["zeros"]), oracle["zeros_marlin"])
    assert torch.equal(layout.unpack_zero_points(oracle["zeros_marlin"], size_n), oracle["zeros"])


@pytest.mark.parametrize("size_k, size_n, group_size", [
    (16, 64, -1), (128, 64, -1), (128, 64, 128), (256, 192, 128), (256, 192, -1), (384, 512, 128), (384, 512, -1)])
def test_round_trip(size_k, size_n, group_size):
    generator = torch.Generator().manual_seed(size_k * size_n)
    codes = torch.randint(0, 16, (size_k, size_n), generator=generator, dtype=torch.int32)
    groups = 1 if group_size == -1 else size_k // group_size
    scales = torch.rand(groups, size_n, generator=generator).half()
    packed, permuted = layout.pack(codes, scales, group_size)
    assert packed.dtype == torch.int32 and packed.shape == (size_k // 16, size_n * 2)
    assert permuted.shape == scales.shape
    codes_back, scales_back = layout.unpack(packed, permuted, size_k, size_n, group_size)
    assert torch.equal(codes_back, codes)
    assert torch.equal(scales_back, scales)
    zeros = torch.randint(0, 16, (groups, size_n), generator=generator, dtype=torch.int32)
    assert torch.equal(layout.unpack_zero_points(layout.pack_zero_points(zeros), size_n), zeros)


def test_concatenated_outputs_pack_as_concatenated_tiles():
    """Fused projections (q|k|v, gate|up) may be packed part by part: runs never cross 64 columns."""
    generator = torch.Generator().manual_seed(7)
    parts = [torch.randint(0, 16, (128, n), generator=generator, dtype=torch.int32) for n in (64, 128)]
    whole = layout.pack_weight(torch.cat(parts, dim=1))
    assert torch.equal(whole, torch.cat([layout.pack_weight(part) for part in parts], dim=1))


def test_dequantize_is_code_minus_eight_times_scale():
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (256, 64), generator=generator, dtype=torch.int32)
    scales = torch.rand(2, 64, generator=generator).half()
    packed, permuted = layout.pack(codes, scales, 128)
    expected = (codes - 8).float() * scales.float().repeat_interleave(128, dim=0)
    assert torch.equal(layout.dequantize(packed, permuted, 256, 64, 128), expected)
    zeros = torch.randint(0, 16, (2, 64), generator=generator, dtype=torch.int32)
    expected = (codes - zeros.repeat_interleave(128, dim=0)).float() * scales.float().repeat_interleave(128, dim=0)
    assert torch.equal(layout.dequantize(packed, permuted, 256, 64, 128, layout.pack_zero_points(zeros)), expected)


@pytest.mark.parametrize("size_k, size_n, group_size, message", [
    (24, 64, -1, "multiple of 16"), (128, 96, -1, "multiple of 64"), (192, 64, 128, "group size 128")])
def test_shapes_the_layout_cannot_hold(size_k, size_n, group_size, message):
    with pytest.raises(ValueError, match=message):
        layout.pack(torch.zeros(size_k, size_n, dtype=torch.int32), torch.zeros(1, size_n), group_size)
