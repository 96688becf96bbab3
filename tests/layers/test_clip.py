"""The CLIP vision tower (layers/clip.py) against transformers' CLIPVisionModel hidden states."""

from __future__ import annotations

import pytest
import torch

from pluginfer.layers.clip import CLIPVisionTower
from pluginfer.layers.context import building
from pluginfer.layers.weights import load_named_weights
from tests.layers.conftest import backend_with, make_context

CLIP = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=56,
            patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5)


@pytest.mark.parametrize("feature_layer", [-2, -1, 1])
def test_hidden_states_match_transformers(feature_layer: int) -> None:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    hf = CLIPVisionModel(CLIPVisionConfig(**CLIP)).eval()
    for param in hf.parameters():
        param.data.normal_(0, 0.2)
    with building(make_context(backend_with(False))):
        tower = CLIPVisionTower(CLIP, feature_layer)
    weights = [(name.removeprefix("vision_model."), tensor) for name, tensor in hf.state_dict().items()]
    load_named_weights(tower, [(n, t) for n, t in weights if not tower.skipped(n) and "position_ids" not in n],
                       stacked=())
    pixels = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = hf(pixels, output_hidden_states=True).hidden_states[feature_layer]
        got = tower(pixels)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
