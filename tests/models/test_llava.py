"""LLaVA through the engine against transformers' generate: images alone, two in one prompt, batched with a
text-only request, through llm.chat, under chunked prefill, prefix caching and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest

from pluginfer import LLM
from tests.models.llava_checkpoint import hf_llava_greedy, save_llava
from tests.models.test_qwen2_vl import TOKENS, data_uri, greedy, image


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    from transformers import AutoImageProcessor, AutoTokenizer

    out = tmp_path_factory.mktemp("llava")
    model = save_llava(out, tiny_tokenizer_dir)
    return out, model, AutoImageProcessor.from_pretrained(out), AutoTokenizer.from_pretrained(out)


def count_llava_tower_runs(llm: LLM) -> list[int]:
    tower = llm.engine.executor.worker.pipeline.vision_tower
    runs: list[int] = []
    forward = tower.forward

    def counted(pixel_values):
        runs.append(int(pixel_values.shape[0]))
        return forward(pixel_values)

    tower.forward = counted
    return runs


def test_generate_matches_transformers(llava) -> None:
    path, model, processor, tokenizer = llava
    first, second = image(60, 90, 0), image(150, 110, 1)
    text, two = "hello <image> what is it", "first <image> then <image> compare"
    plain = tokenizer.encode("a text only request about the weather")
    want = [hf_llava_greedy(model, processor, tokenizer.encode(text), [first], TOKENS),
            hf_llava_greedy(model, processor, tokenizer.encode(two), [second, first], TOKENS),
            hf_llava_greedy(model, processor, plain, [], TOKENS)]
    with LLM(str(path), dtype="float32", max_model_len=512) as llm:
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": first}},
                                {"prompt": two, "multi_modal_data": {"image": [second, first]}},
                                {"prompt_token_ids": plain}], greedy())
        assert [o.outputs[0].token_ids for o in outputs] == want
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(first)}},
                                                 {"type": "text", "text": "what is it"}]}]
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "what is it"}]}], add_generation_prompt=True, tokenize=False)
        chat_want = hf_llava_greedy(model, processor, tokenizer.encode(rendered, add_special_tokens=False), [first],
                                    TOKENS)
        assert llm.chat(messages, greedy())[0].outputs[0].token_ids == chat_want


def test_chunked_prefill_prefix_cache_and_preemption(llava) -> None:
    path, model, processor, tokenizer = llava
    text = "look <image> and describe"
    images = [image(60, 60, 2), image(60, 60, 3)]
    want = [hf_llava_greedy(model, processor, tokenizer.encode(text), [img], TOKENS) for img in images]
    prompts = [{"prompt": text, "multi_modal_data": {"image": img}} for img in images]
    with LLM(str(path), dtype="float32", max_model_len=512, max_num_batched_tokens=16, block_size=4) as llm:
        runs = count_llava_tower_runs(llm)
        for prompt, expected in zip(prompts, want):
            assert llm.generate(prompt, greedy())[0].outputs[0].token_ids == expected
        assert runs == [1, 1]  # each request's image encoded once over its chunks
        assert [o.outputs[0].token_ids for o in llm.generate(prompts * 2, greedy())] == want * 2
    with LLM(str(path), dtype="float32", max_model_len=512, num_blocks=8, block_size=8) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts * 2, greedy())] == want * 2


@pytest.mark.slow
def test_two_tensor_parallel_ranks(llava) -> None:
    """The CLIP tower's heads, the projector and the decoder split over two spawned ranks."""
    path, model, processor, tokenizer = llava
    text = "hello <image> what is it"
    images = [image(60, 90, 0), image(150, 110, 1)]
    want = [hf_llava_greedy(model, processor, tokenizer.encode(text), [img], TOKENS) for img in images]
    with LLM(str(path), dtype="float32", max_model_len=512, tensor_parallel_size=2) as llm:
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": img}} for img in images], greedy())
    assert [o.outputs[0].token_ids for o in outputs] == want
