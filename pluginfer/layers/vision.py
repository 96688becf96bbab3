"""A Qwen2-VL-style vision transformer: 3-D patch embedding, 2-D rotary, bidirectional blocks, patch merger.

Qwen2.5-VL's tower (a ``vision_config`` with ``fullatt_block_indexes``) has RMSNorms, a gated MLP, and windowed
attention in every block but those: its patches are put in window order for the blocks and back after the merger.

Input is what transformers' Qwen2-VL image processor returns: ``pixel_values`` ``[patches, C*T*P*P]`` and
``grid_thw`` ``[images, 3]`` (patches of each image in time, height and width, already ordered by merge window).
Each image attends only to its own patches. Parameter names follow HF checkpoints (``visual.*``). Under tensor
parallelism the heads and the MLPs' hidden features are split across ranks, as in the decoder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.layers.activation import activation
from pluginfer.layers.context import current_context
from pluginfer.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pluginfer.layers.norm import LayerNorm, RMSNorm


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)`` (CLIP's, Qwen2-VL's ``quick_gelu``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def vision_activation(name: str) -> nn.Module:
    return QuickGELU() if name == "quick_gelu" else activation(name)


class PatchEmbed(nn.Module):
    """A Conv3d with stride equal to its kernel over each flattened patch: one matmul."""

    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, embed_dim: int) -> None:
        super().__init__()
        self.kernel = (temporal_patch_size, patch_size, patch_size)
        self.in_channels, self.embed_dim = in_channels, embed_dim
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(embed_dim, in_channels, *self.kernel,
                                                    dtype=current_context().dtype), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return pixels.to(weight.dtype) @ weight.reshape(self.embed_dim, -1).t()


class VisionRotary(nn.Module):
    """2-D rotary: a quarter of the head's frequencies turn with the patch's row, a quarter with its column."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        quarter = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))

    def forward(self, grid_thw: torch.Tensor, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[patches, head_dim]`` (float32) for the patches in the processor's order."""
        positions = vision_positions(grid_thw, merge_size)  # [patches, 2]: row, column
        freqs = (positions[..., None].float() * self.inv_freq).flatten(1)  # [patches, head_dim / 2]
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


def vision_positions(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """(row, column) of every patch, each image's patches in merge-window order, repeated over time."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype, x = x.dtype, x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(dtype)


class VisionAttention(nn.Module):
    """Bidirectional attention within each image (``cu_seqlens``), rotary on q and k; heads split across
    tensor-parallel ranks (the checkpoint's fused ``qkv`` is split per projection)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.qkv = QKVParallelLinear(dim, self.head_dim, num_heads, num_heads, bias=True)
        self.num_heads = self.qkv.num_heads  # this rank's
        self.proj = RowParallelLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs = []
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # one image each: a handful per step
            # batched 4-D: torch's CPU flash kernel takes only 4-D inputs (3-D falls back to the slow math path)
            qi, ki, vi = (t[None, start:end].transpose(1, 2) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi)[0].transpose(0, 1))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.proj(out.reshape(x.shape[0], -1))  # RowParallelLinear all-reduces the ranks' parts


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, bias=True)
        self.act = vision_activation(hidden_act)
        self.fc2 = RowParallelLinear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's ``down_proj(act(gate_proj(x)) * up_proj(x))``, with biases."""

    def __init__(self, dim: int, hidden: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, hidden, bias=True)
        self.up_proj = ColumnParallelLinear(dim, hidden, bias=True)
        self.act = vision_activation(hidden_act)
        self.down_proj = RowParallelLinear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``+ mlp(norm2(x))`` (Qwen2-VL: LayerNorms and a
    plain MLP; Qwen2.5-VL, ``gated``: RMSNorms and a gated MLP)."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, hidden_act: str, eps: float = 1e-6,
                 gated: bool = False) -> None:
        super().__init__()
        norm = RMSNorm if gated else LayerNorm
        self.norm1, self.norm2 = norm(dim, eps), norm(dim, eps)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = GatedVisionMLP(dim, mlp_hidden, hidden_act) if gated else VisionMLP(dim, mlp_hidden, hidden_act)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, then each ``merge x merge`` window of patches concatenated and projected to the text width."""

    def __init__(self, out_dim: int, context_dim: int, merge_size: int, eps: float = 1e-6, rms: bool = False) -> None:
        super().__init__()
        self.width = context_dim * merge_size**2
        self.ln_q = RMSNorm(context_dim, eps) if rms else LayerNorm(context_dim, eps)
        self.mlp = nn.ModuleList([ColumnParallelLinear(self.width, self.width, bias=True), nn.GELU(),
                                  RowParallelLinear(self.width, out_dim, bias=True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class VisionTransformer(nn.Module):
    """Qwen2-VL's (or Qwen2.5-VL's) vision tower from its ``vision_config``: pixels -> one text-width embedding
    per merged patch."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.windowed = "fullatt_block_indexes" in config  # Qwen2.5-VL
        heads = config["num_heads"]
        dim = config["hidden_size"] if self.windowed else config["embed_dim"]
        out_dim = config["out_hidden_size"] if self.windowed else config["hidden_size"]
        self.merge_size = config.get("spatial_merge_size", 2)
        self.patch_size = config.get("patch_size", 14)
        self.full_blocks = set(config.get("fullatt_block_indexes") or ())
        self.window_size = config.get("window_size", 112)
        self.patch_embed = PatchEmbed(self.patch_size, config.get("temporal_patch_size", 2),
                                      config.get("in_channels", 3), dim)
        theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(dim // heads, theta)
        hidden = config["intermediate_size"] if self.windowed else int(dim * config.get("mlp_ratio", 4))
        act = config.get("hidden_act", "silu" if self.windowed else "quick_gelu")
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, hidden, act, gated=self.windowed)
                                    for _ in range(config["depth"]))
        self.merger = PatchMerger(out_dim, dim, self.merge_size, rms=self.windowed)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[merged patches of all images, out dim]``, the images one after another."""
        sizes = (grid_thw[:, 1] * grid_thw[:, 2]).repeat_interleave(grid_thw[:, 0])  # one frame: one attention span
        cu_seqlens = [0, *torch.cumsum(sizes, 0).tolist()]
        cos, sin = self.rotary(grid_thw, self.merge_size)
        x = self.patch_embed(pixel_values)
        order, cu_windows = None, cu_seqlens
        if self.windowed:  # patches in window order, a merge window's patches kept together
            windows, cu_windows = window_index(grid_thw, self.merge_size, self.window_size, self.patch_size)
            unit = self.merge_size**2
            order = (windows[:, None] * unit + torch.arange(unit)).flatten().to(x.device)
            x, cos, sin = x[order], cos[order], sin[order]
        for index, block in enumerate(self.blocks):
            full = not self.windowed or index in self.full_blocks
            x = block(x, cu_seqlens if full else cu_windows, cos, sin)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(windows).to(merged.device)]
        return merged


def window_index(grid_thw: torch.Tensor, merge_size: int, window_size: int,
                 patch_size: int) -> tuple[torch.Tensor, list[int]]:
    """(merged patches in window order, the windows' cumulative patch counts) as Qwen2.5-VL tiles each frame
    into windows of ``window_size`` pixels."""
    side = window_size // merge_size // patch_size  # merged patches along a window's side
    unit = merge_size**2
    order, bounds, offset = [], [0], 0
    for t, h, w in grid_thw.tolist():
        h, w = h // merge_size, w // merge_size
        index = torch.arange(t * h * w).reshape(t, h, w)
        pad_h, pad_w = side - h % side, side - w % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -1)
        rows, cols = (h + pad_h) // side, (w + pad_w) // side
        padded = padded.reshape(t, rows, side, cols, side).permute(0, 1, 3, 2, 4).reshape(t, rows * cols, -1)
        counts = (padded >= 0).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat >= 0] + offset)
        for count in counts.tolist():
            if count:  # an empty (all-padding) window adds no boundary
                bounds.append(bounds[-1] + count * unit)
        offset += t * h * w
    return torch.cat(order), bounds
