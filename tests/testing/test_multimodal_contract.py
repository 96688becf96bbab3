"""The built-in image processors pass the multimodal processor conformance kit, each loaded through the registry
by its checkpoint's architectures, as a third party's would be."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pluginfer.core.registry import Registry
from pluginfer.testing.multimodal_contract import check_multimodal_processor
from tests.models.llava_checkpoint import save_llava
from tests.models.qwen2_vl_checkpoint import IMAGE_PLACEHOLDER, save_qwen2_vl


def image(height: int, width: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("family", ["qwen2-vl", "llava"])
def test_the_built_in_processors_keep_the_contract(family: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    if family == "qwen2-vl":
        save_qwen2_vl(tmp_path, tiny_tokenizer_dir)
        text = f"hello {IMAGE_PLACEHOLDER} what is it"
    else:
        save_llava(tmp_path, tiny_tokenizer_dir)
        text = "hello <image> what is it"
    hf_config = json.loads((tmp_path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    factory = Registry.discover().multimodal_processor(hf_config["architectures"])
    assert factory is not None
    check_multimodal_processor(factory, str(tmp_path), hf_config, tokenizer, tokenizer.encode(text), "image",
                               [image(60, 90, 0), image(60, 90, 1), image(150, 110, 2)])


class SameHashForAll:
    """Expands its one placeholder (id 7) to two tokens but hashes every image alike: the kit must catch it."""

    modalities = ("image",)

    def process(self, token_ids, data):
        from pluginfer.core.protocols import MultiModalPrompt

        items = data["image"] if isinstance(data["image"], list) else [data["image"]]
        if len(items) != token_ids.count(7) or not all(hasattr(item, "size") for item in items):
            raise ValueError("multi_modal_data image: not what the prompt holds")
        return MultiModalPrompt([t for token in token_ids for t in ([token] * 2 if token == 7 else [token])],
                                None, b"same")


def test_the_kit_catches_a_processor_whose_hash_ignores_the_image() -> None:
    with pytest.raises(AssertionError, match="different items must give different content hashes"):
        check_multimodal_processor(lambda *args: SameHashForAll(), "dir", {}, None, [1, 7, 2], "image",
                                   [image(20, 20, 0), image(20, 20, 1)])
