"""The Qwen2-VL vision tower (layers/vision.py) against transformers' own, with its weights."""

from __future__ import annotations

import pytest
import torch

from pluginfer.layers.context import building
from pluginfer.layers.vision import VisionTransformer, vision_positions
from pluginfer.layers.weights import load_named_weights
from tests.layers.conftest import backend_with, make_context

VISION = dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, mlp_ratio=2, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu")


def hf_tower():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(0)
    model = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**VISION)).eval()
    for param in model.parameters():  # random biases and norms too, so that every tensor is exercised
        param.data.normal_(0, 0.2)
    return model


def ours(hf) -> VisionTransformer:
    with building(make_context(backend_with(False))):
        tower = VisionTransformer(VISION)
    load_named_weights(tower, hf.state_dict().items(), stacked=())
    return tower


@pytest.mark.parametrize("grids", [[[1, 4, 6]], [[1, 2, 2], [1, 6, 4]], [[2, 4, 4]]])
def test_tower_matches_transformers(grids: list[list[int]]) -> None:
    hf = hf_tower()
    grid = torch.tensor(grids)
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = hf(pixels, grid_thw=grid).pooler_output
        got = ours(hf)(pixels, grid)
    assert got.shape == (patches // 4, VISION["hidden_size"])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_positions_match_transformers() -> None:
    from transformers.vision_utils import get_vision_position_ids

    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    assert torch.equal(vision_positions(grid, 2), get_vision_position_ids(grid, 2))


VISION_25 = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=40, patch_size=14,
                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="silu", window_size=56,
                 fullatt_block_indexes=[1])


@pytest.mark.parametrize("grids", [[[1, 6, 10]], [[1, 4, 4], [1, 10, 6]]])
def test_qwen2_5_tower_matches_transformers(grids: list[list[int]]) -> None:
    """Windows of 2x2 merged patches (56 px) over grids that do not divide into them, one full-attention block."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    hf = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**VISION_25)).eval()
    for param in hf.parameters():
        param.data.normal_(0, 0.2)
    with building(make_context(backend_with(False))):
        tower = VisionTransformer(VISION_25)
    load_named_weights(tower, hf.state_dict().items(), stacked=())
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = hf(pixels, grid_thw=grid).pooler_output
        got = tower(pixels, grid)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
