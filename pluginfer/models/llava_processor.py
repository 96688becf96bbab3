"""LLaVA's multimodal processor: images through the checkpoint's own image processor (transformers' CLIP one),
each ``<image>`` placeholder expanded to the tower's patch count."""

from __future__ import annotations

import hashlib
from typing import Any

from pluginfer.core.protocols import MultiModalPrompt
from pluginfer.layers.multimodal import checked_images, placeholder_index, require_pillow
from pluginfer.models.llava import LlavaInputs


class LlavaProcessor:
    """A ``MultiModalProcessor`` (core.protocols) for LLaVA checkpoints."""

    modalities = ("image",)

    def __init__(self, model_path: str, hf_config: dict, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        require_pillow()

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id = int(hf_config.get("image_token_id", hf_config.get("image_token_index")))
        vision = hf_config["vision_config"]
        full = hf_config.get("vision_feature_select_strategy", "default") == "full"
        self.tokens_per_image = (vision["image_size"] // vision["patch_size"]) ** 2 + int(full)

    def process(self, token_ids: list[int], data: dict[str, Any]) -> MultiModalPrompt:
        images = checked_images(data, token_ids, self.image_token_id, "<image>")
        try:
            pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        except Exception as exc:
            # the image processor's own words name what it could not read
            raise ValueError(f"multi_modal_data image: cannot be processed: {exc}") from None
        expanded: list[int] = []
        for token in token_ids:
            expanded.extend([token] * self.tokens_per_image if token == self.image_token_id else [token])
        content_hash = hashlib.blake2b(pixels.float().numpy().tobytes(), digest_size=16).digest()
        inputs = LlavaInputs(pixels, placeholder_index(expanded, self.image_token_id), content_hash)
        return MultiModalPrompt(expanded, inputs, content_hash)


def build(model_path: str, hf_config: dict, tokenizer: Any) -> LlavaProcessor:
    return LlavaProcessor(model_path, hf_config, tokenizer)
