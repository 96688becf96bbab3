"""What every image-in pipeline shares: a decoder fed with embeddings, the image embeddings put at the rows of
their placeholder tokens, and an LRU cache of a request's encoded images by content hash.

A pipeline's per-request inputs (``ForwardBatch.multimodal[row]``) carry ``embed_index`` (``[prompt tokens]``:
the row of the request's image embeddings each prompt token takes, -1 for text) and ``content_hash``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.layers.causal_lm import DecoderStack

# requests' image embeddings kept (chunked prefill, recompute, repeated images)
ENCODER_CACHE_ENTRIES = 32


class EmbeddedDecoder(DecoderStack):
    """The decoder stack fed with embeddings (the tokens', images' in place) instead of token ids."""

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        residual = None
        for index in self.layer_range:
            hidden, residual = self.layers[index](batch, hidden, residual)
        rows = batch.logits_indices
        return self.norm(hidden[rows] + residual[rows])


class EncoderCache:
    """A request's image embeddings by content hash: encoded once, reused by its later chunks and recompute."""

    def __init__(self, encode: Callable[[Any, torch.device], torch.Tensor],
                 entries: int = ENCODER_CACHE_ENTRIES) -> None:
        self.encode, self.entries = encode, entries
        self._encoded: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __call__(self, inputs: Any, device: torch.device) -> torch.Tensor:
        cached = self._encoded.get(inputs.content_hash)
        if cached is not None:
            self._encoded.move_to_end(inputs.content_hash)
            return cached
        encoded = self.encode(inputs, device)
        self._encoded[inputs.content_hash] = encoded
        if len(self._encoded) > self.entries:
            self._encoded.popitem(last=False)
        return encoded


def with_images(batch: ForwardBatch, hidden: torch.Tensor, encoded: EncoderCache) -> torch.Tensor:
    """``hidden`` (the step's token embeddings) with each image token's row replaced by its image embedding."""
    starts = batch.query_start_loc.tolist()
    rows, embeds = [], []
    for row, inputs in batch.multimodal.items():  # the rows with images: a few per step
        first, end = starts[row], starts[row + 1]
        index = batch.positions[first:end]
        in_prompt = index < inputs.embed_index.shape[0]
        slots = torch.full_like(index, -1)
        slots[in_prompt] = inputs.embed_index.to(index.device)[index[in_prompt]]
        takes = slots >= 0
        if bool(takes.any()):
            rows.append(torch.arange(first, end, device=index.device)[takes])
            embeds.append(encoded(inputs, index.device)[slots[takes]])
    if not rows:
        return hidden
    return hidden.index_put((torch.cat(rows),), torch.cat(embeds).to(hidden.dtype))


def require_pillow() -> None:
    """Images need Pillow (an optional dependency): say how to get it."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ImportError("this model takes images, which need Pillow: pip install 'pluginfer[vision]'") from None


MAX_IMAGES_PER_PROMPT = 16


def checked_images(data: dict, token_ids: list[int], token_id: int, placeholder: str) -> list:
    """A prompt's ``multi_modal_data`` images, each a PIL image, as many as its ``token_id`` placeholders
    (``placeholder``: how the prompt writes one, for the error)."""
    from PIL import Image

    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(images) > MAX_IMAGES_PER_PROMPT:
        raise ValueError(f"multi_modal_data: {len(images)} images, more than the {MAX_IMAGES_PER_PROMPT} "
                         "a prompt may carry")
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data image {index}: expected a PIL image, got {type(image).__name__}")
    placeholders = token_ids.count(token_id)
    if placeholders != len(images):
        raise ValueError(f"multi_modal_data: the prompt has {placeholders} image placeholder(s) ({placeholder}) "
                         f"for {len(images)} image(s)")
    return images


def placeholder_index(token_ids: list[int], token_id: int) -> torch.Tensor:
    """``embed_index`` of a prompt whose image tokens are ``token_id``: their order among them, -1 elsewhere."""
    is_image = torch.tensor(token_ids) == token_id
    index = torch.full((len(token_ids),), -1, dtype=torch.long)
    index[is_image] = torch.arange(int(is_image.sum()))
    return index
