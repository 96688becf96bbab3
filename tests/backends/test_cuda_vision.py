"""Qwen2-VL on the cuda backend, its Triton kernels under Triton's interpreter on CPU tensors (as
tests/backends/test_cuda_engine.py runs the text families): the vision tower runs on torch ops on the backend's
device, the decoder's M-RoPE through the backend's rotary kernel; greedy tokens equal transformers', images and a
text-only prompt batched, the second group over the first's cached blocks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.backends.test_cuda_engine import run_engine
from tests.models.qwen2_vl_checkpoint import IMAGE_PLACEHOLDER, hf_image_greedy, save_qwen2_vl
from tests.models.test_qwen2_vl import image

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                   reason="triton is not installed (the test extra has it)")]
MAX_TOKENS = 8  # as run_engine asks for


def test_qwen2_vl_on_the_cuda_backend(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    model = save_qwen2_vl(tmp_path / "qwen2_vl", tiny_tokenizer_dir)
    processor, tokenizer = AutoImageProcessor.from_pretrained(tmp_path / "qwen2_vl"), \
        AutoTokenizer.from_pretrained(tmp_path / "qwen2_vl")
    files = []
    for index, (height, width) in enumerate([(60, 90), (150, 110)]):
        files.append(tmp_path / f"image{index}.png")
        image(height, width, index).save(files[-1])
    ids = tokenizer.encode(f"hello {IMAGE_PLACEHOLDER} what is in it")
    plain = tokenizer.encode("a text only request")
    images = [[image(60, 90, 0)], [image(150, 110, 1)]]
    want = [hf_image_greedy(model, processor, ids, imgs, MAX_TOKENS) for imgs in images]
    want_plain = hf_image_greedy(model, processor, plain, [], MAX_TOKENS)
    groups = [[{"prompt_token_ids": ids, "images": [str(files[0])]}, plain],
              [{"prompt_token_ids": ids, "images": [str(files[1])]}, {"prompt_token_ids": ids,
                                                                      "images": [str(files[0])]}]]
    result = run_engine(tmp_path, tmp_path / "qwen2_vl", groups, max_model_len=512)
    assert result["backend"] == "cuda"
    assert result["tokens"] == [[want[0], want_plain], [want[1], want[0]]]
    assert result["cached_tokens"][1][1] > 0 and result["cached_tokens"][1][0] == 0  # same image: its blocks
    assert {"rotary_neox", "paged_prefill_attention", "paged_decode_attention"} <= set(result["kernel_calls"])
