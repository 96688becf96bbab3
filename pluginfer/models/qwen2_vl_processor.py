"""Qwen2-VL's multimodal processor: images through the checkpoint's own image processor (transformers'), each
``<|image_pad|>`` placeholder expanded to the image's merged patches, M-RoPE positions of the prompt."""

from __future__ import annotations

import hashlib
from typing import Any

from pluginfer.core.protocols import MultiModalPrompt
from pluginfer.layers.mrope import mrope_positions
from pluginfer.layers.multimodal import checked_images, placeholder_index, require_pillow
from pluginfer.models.qwen2_vl import Qwen2VLInputs


class Qwen2VLProcessor:
    """A ``MultiModalProcessor`` (core.protocols) for Qwen2-VL checkpoints."""

    modalities = ("image",)

    def __init__(self, model_path: str, hf_config: dict, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        require_pillow()

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id = int(hf_config["image_token_id"])
        self.merge_size = int(hf_config["vision_config"].get("spatial_merge_size", 2))

    def process(self, token_ids: list[int], data: dict[str, Any]) -> MultiModalPrompt:
        images = checked_images(data, token_ids, self.image_token_id, "<|vision_start|><|image_pad|><|vision_end|>")
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except Exception as exc:  # the image processor's own words name what it could not read
            raise ValueError(f"multi_modal_data image: cannot be processed: {exc}") from None
        pixels, grid = out["pixel_values"], out["image_grid_thw"].long()
        counts = iter((grid.prod(-1) // self.merge_size**2).tolist())
        expanded: list[int] = []
        for token in token_ids:
            expanded.extend([token] * next(counts) if token == self.image_token_id else [token])
        positions, delta = mrope_positions(expanded, self.image_token_id, grid, self.merge_size)
        embed_index = placeholder_index(expanded, self.image_token_id)
        digest = hashlib.blake2b(pixels.float().numpy().tobytes(), digest_size=16)
        digest.update(grid.numpy().tobytes())
        content_hash = digest.digest()
        inputs = Qwen2VLInputs(pixels, grid, positions, delta, embed_index, content_hash)
        return MultiModalPrompt(expanded, inputs, content_hash)


def build(model_path: str, hf_config: dict, tokenizer: Any) -> Qwen2VLProcessor:
    return Qwen2VLProcessor(model_path, hf_config, tokenizer)
