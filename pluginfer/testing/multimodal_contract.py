"""Conformance kit: what every multimodal processor plugin owes the engine.

A processor plugin's tests call ``check_multimodal_processor`` with the spec's factory, a saved checkpoint it
reads, a tokenized prompt holding one placeholder and a few distinct media items. It raises AssertionError
on the first broken promise of ``pluginfer.core.protocols.MultiModalProcessor``:

- ``modalities`` is a non-empty tuple of the ``multi_modal_data`` keys it takes;
- ``process`` returns a ``MultiModalPrompt``: token ids (ints, at least the prompt's), ``inputs`` that pickle
  (they travel to other ranks), a non-empty ``content_hash`` as bytes;
- one item and a list of that one item are the same request; the same item twice gives the same hash and ids;
- different items give different hashes (prompts with different media never share prefix-cache blocks);
- more items than placeholders, and items that are not media, are ``ValueError``s (a 400 at the server).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

from pluginfer.core.protocols import MultiModalProcessor, MultiModalPrompt


def _process(processor: MultiModalProcessor, prompt_ids: list[int], data: dict[str, Any]) -> MultiModalPrompt:
    prompt = processor.process(list(prompt_ids), data)
    assert isinstance(prompt, MultiModalPrompt), f"process returned {type(prompt).__name__}, not a MultiModalPrompt"
    assert isinstance(prompt.token_ids, list) and all(isinstance(t, int) for t in prompt.token_ids), \
        "MultiModalPrompt.token_ids must be a list of ints"
    assert len(prompt.token_ids) >= len(prompt_ids), "placeholders are expanded, never dropped"
    assert isinstance(prompt.content_hash, bytes) and prompt.content_hash, "content_hash must be non-empty bytes"
    pickle.loads(pickle.dumps(prompt.inputs))  # the inputs ride to every tensor-parallel rank
    return prompt


def _raises_value_error(processor: MultiModalProcessor, prompt_ids: list[int], data: dict[str, Any],
                        what: str) -> None:
    try:
        processor.process(list(prompt_ids), data)
    except ValueError:
        return
    raise AssertionError(f"{what}: process must raise ValueError (the server answers 400)")


def check_multimodal_processor(factory: Callable[..., MultiModalProcessor], model_path: str, hf_config: dict,
                               tokenizer: Any, prompt_ids: list[int], modality: str, items: Sequence[Any],
                               bad_items: Sequence[Any] = ("not media", b"\x00\x01\x02", 3)) -> None:
    """``prompt_ids``: a tokenized prompt with one ``modality`` placeholder. ``items``: at least two distinct
    media items of ``modality`` (e.g. PIL images of different sizes). ``bad_items``: values that are not media."""
    assert len(items) >= 2, "give at least two distinct items"
    processor = factory(model_path, hf_config, tokenizer)
    assert isinstance(processor, MultiModalProcessor), "the factory must return a MultiModalProcessor"
    assert isinstance(processor.modalities, tuple) and processor.modalities \
        and all(isinstance(m, str) for m in processor.modalities), "modalities must be a non-empty tuple of str"
    assert modality in processor.modalities, f"{modality!r} is not among the modalities {processor.modalities}"
    prompts = [_process(processor, prompt_ids, {modality: item}) for item in items]
    again = _process(processor, prompt_ids, {modality: [items[0]]})
    assert (again.token_ids, again.content_hash) == (prompts[0].token_ids, prompts[0].content_hash), \
        "the same item (alone or in a list of one) must give the same token ids and content_hash"
    hashes = [prompt.content_hash for prompt in prompts]
    assert len(set(hashes)) == len(hashes), "different items must give different content hashes"
    _raises_value_error(processor, prompt_ids, {modality: list(items[:2])}, "two items for one placeholder")
    for bad in bad_items:
        _raises_value_error(processor, prompt_ids, {modality: bad}, f"the item {bad!r}")
