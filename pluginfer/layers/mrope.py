"""Multimodal rotary positions (M-RoPE, Qwen2-VL): three position ids per token (time, height, width).

Text tokens carry the same id in all three rows; an image's tokens carry their grid coordinates. Each
section of the rotary frequencies (``mrope_section``) turns with one of the rows.
"""

from __future__ import annotations

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.layers.rotary import RotaryEmbedding

# ForwardBatch.extras key of the step's [3, tokens] positions (absent: every row's plain positions)
MROPE_POSITIONS = "mrope_positions"


class MRotaryEmbedding(RotaryEmbedding):
    """Neox rope whose frequency ``i`` reads position row ``section_of(i) % 3``."""

    def __init__(self, head_dim: int, max_position: int, base: float, mrope_section: list[int]) -> None:
        super().__init__(head_dim, head_dim, max_position, base)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"rope_scaling.mrope_section: {mrope_section} must sum to head_dim / 2 ({head_dim // 2})")
        self.row_of = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(mrope_section)])

    def _tables(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("rope", id(self))
        if key not in batch.extras:
            positions = batch.extras.get(MROPE_POSITIONS)
            if positions is None:
                positions = batch.positions.expand(3, -1)
            rows = positions[self.row_of.to(positions.device)]  # [rotary_dim / 2, tokens]
            freqs = rows.t().float() * self.inv_freq.to(rows.device)
            batch.extras[key] = (freqs.cos(), freqs.sin())
        return batch.extras[key]


def mrope_positions(token_ids: list[int], image_token_id: int, grid_thw: torch.Tensor,
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """([3, len(token_ids)] positions of a prompt whose image tokens come in runs, one run per ``grid_thw`` row,
    and the delta that later positions add to their index)."""
    ids = torch.tensor(token_ids)
    grids = iter(grid_thw.tolist())
    parts, position, index = [], 0, 0
    while index < len(token_ids):
        if ids[index] == image_token_id:
            t, h, w = next(grids)
            h, w = h // merge_size, w // merge_size
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            parts.append(grid.reshape(3, -1) + position)
            position += max(h, w)
            index += t * h * w
        else:
            end = index
            while end < len(token_ids) and ids[end] != image_token_id:
                end += 1
            parts.append(torch.arange(position, position + end - index).expand(3, -1))
            position += end - index
            index = end
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - len(token_ids)
