"""Qwen2-VL through the engine against transformers' generate: images of two sizes, alone, several in one
prompt, batched with a text-only request, through llm.chat with data URIs, under chunked prefill, prefix
caching and preemption."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from pluginfer import LLM, SamplingParams
from pluginfer.engine.beam_search import BeamSearchParams
from tests.models.qwen2_vl_checkpoint import IMAGE_PLACEHOLDER, hf_image_greedy, save_qwen2_vl

TOKENS = 8


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2-vl", "qwen2.5-vl"])
def qwen2_vl(request, tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    from transformers import AutoImageProcessor, AutoTokenizer

    out = tmp_path_factory.mktemp("qwen2_vl")
    model = save_qwen2_vl(out, tiny_tokenizer_dir, version=request.param)
    return out, model, AutoImageProcessor.from_pretrained(out), AutoTokenizer.from_pretrained(out)


def image(height: int, width: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)


def make_llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=512, **kwargs)


def test_generate_matches_transformers(qwen2_vl) -> None:
    path, model, processor, tokenizer = qwen2_vl
    small, large = image(60, 90, 0), image(150, 110, 1)
    text = f"hello {IMAGE_PLACEHOLDER} what is in the picture"
    two = f"first {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} compare"
    plain = tokenizer.encode("a text only request about the weather")
    ids, two_ids = tokenizer.encode(text), tokenizer.encode(two)
    want = [hf_image_greedy(model, processor, ids, [small], TOKENS),
            hf_image_greedy(model, processor, ids, [large], TOKENS),
            hf_image_greedy(model, processor, two_ids, [large, small], TOKENS),
            hf_image_greedy(model, processor, plain, [], TOKENS)]
    with make_llm(path) as llm:
        alone = [llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, greedy())[0]
                 for img in (small, large)]
        assert [o.outputs[0].token_ids for o in alone] == want[:2]
        batched = llm.generate([{"prompt": text, "multi_modal_data": {"image": small}},
                                {"prompt": text, "multi_modal_data": {"image": large}},
                                {"prompt": two, "multi_modal_data": {"image": [large, small]}},
                                {"prompt_token_ids": plain}], greedy())
        assert [o.outputs[0].token_ids for o in batched] == want
        two_choices = SamplingParams(n=2, temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        choices = llm.generate({"prompt": text, "multi_modal_data": {"image": large}}, two_choices)[0].outputs
        assert [c.token_ids for c in choices] == [want[1]] * 2  # the second choice forks the first's blocks
        with pytest.raises(ValueError, match="beam_search"):
            llm.beam_search({"prompt": text, "multi_modal_data": {"image": large}}, BeamSearchParams(beam_width=2, max_tokens=2))


def test_chunked_prefill_prefix_cache_and_preemption(qwen2_vl) -> None:
    """A chunk boundary inside the image's tokens; two images behind the same text never share blocks; a tiny
    cache preempts and recomputes."""
    path, model, processor, tokenizer = qwen2_vl
    text = f"look {IMAGE_PLACEHOLDER} and describe"
    ids = tokenizer.encode(text)
    images = [image(150, 110, 2), image(150, 110, 3)]
    want = [hf_image_greedy(model, processor, ids, [img], TOKENS) for img in images]
    prompts = [{"prompt": text, "multi_modal_data": {"image": img}} for img in images]
    with make_llm(path, max_num_batched_tokens=16, enable_chunked_prefill=True, block_size=4) as llm:
        encoded = count_tower_runs(llm)
        for prompt, expected in zip(prompts, want):  # one after the other: the second could hit the first's blocks
            assert llm.generate(prompt, greedy())[0].outputs[0].token_ids == expected
        assert len(ids) + 20 > 16 and encoded == [1, 1]  # prompts over two chunks, each request's image encoded once
        assert [o.outputs[0].token_ids for o in llm.generate(prompts * 2, greedy())] == want * 2
    with make_llm(path, num_blocks=8, block_size=8) as llm:  # 64 slots: the four cannot all stay
        assert [o.outputs[0].token_ids for o in llm.generate(prompts * 2, greedy())] == want * 2


def count_tower_runs(llm: LLM) -> list[int]:
    """A list that holds how many images each run of the vision tower encoded (the tower is wrapped)."""
    tower = llm.engine.executor.worker.pipeline.visual
    runs: list[int] = []
    forward = tower.forward

    def counted(pixel_values, grid_thw):
        runs.append(int(grid_thw.shape[0]))
        return forward(pixel_values, grid_thw)

    tower.forward = counted
    return runs


def data_uri(img) -> str:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_with_image_url_parts(qwen2_vl) -> None:
    path, model, processor, tokenizer = qwen2_vl
    img = image(60, 90, 4)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this "},
                                             {"type": "image_url", "image_url": {"url": data_uri(img)}}]}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "what is this "}, {"type": "image"}]}], add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    want = hf_image_greedy(model, processor, ids, [img], TOKENS)
    with make_llm(path) as llm:
        assert llm.chat(messages, greedy())[0].outputs[0].token_ids == want
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\].*base64"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}])
        with pytest.raises(ValueError, match="placeholder"):
            llm.generate({"prompt": "no placeholder here", "multi_modal_data": {"image": img}}, greedy())


def test_images_to_a_text_only_model(tiny_llama_checkpoint) -> None:
    with LLM(str(tiny_llama_checkpoint[0]), dtype="float32") as llm:
        with pytest.raises(ValueError, match="takes text only"):
            llm.generate({"prompt": "hi", "multi_modal_data": {"image": image(30, 30, 0)}})


def test_mrope_positions_match_transformers(qwen2_vl) -> None:
    from pluginfer.layers.mrope import mrope_positions

    _, model, _, _ = qwen2_vl
    pad = model.config.image_token_id
    ids = [5, 6] + [pad] * 6 + [7, 8, 9] + [pad] * 4 + [10]
    grid = torch.tensor([[1, 4, 6], [1, 4, 4]])
    want, delta = model.model.get_rope_index(torch.tensor([ids]), (torch.tensor([ids]) == pad).int(), grid)
    got, got_delta = mrope_positions(ids, pad, grid, 2)
    assert torch.equal(got, want[:, 0]) and got_delta == int(delta)


@pytest.mark.slow
def test_two_tensor_parallel_ranks(qwen2_vl) -> None:
    """The tower's heads and MLPs and the decoder split over two spawned ranks: transformers' tokens still."""
    path, model, processor, tokenizer = qwen2_vl
    text = f"hello {IMAGE_PLACEHOLDER} what"
    images = [image(60, 90, 0), image(150, 110, 1)]
    want = [hf_image_greedy(model, processor, tokenizer.encode(text), [img], TOKENS) for img in images]
    with make_llm(path, tensor_parallel_size=2) as llm:
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": img}} for img in images], greedy())
    assert [o.outputs[0].token_ids for o in outputs] == want
