"""A CLIP vision tower (LLaVA's): patch embedding with a class token and learned positions, pre-LayerNorm
encoder layers; returns the hidden states after a chosen number of layers (LLaVA reads the second to last).

Parameter names follow HF's ``CLIPVisionModel`` (``embeddings.*``, ``pre_layrnorm``, ``encoder.layers.*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.layers.context import current_context
from pluginfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from pluginfer.layers.norm import LayerNorm
from pluginfer.layers.vision import vision_activation


class CLIPEmbeddings(nn.Module):
    def __init__(self, hidden: int, image_size: int, patch_size: int, channels: int) -> None:
        super().__init__()
        dtype = current_context().dtype
        self.patch_size, self.hidden = patch_size, hidden
        self.num_positions = (image_size // patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = nn.Parameter(torch.empty(hidden, channels, patch_size, patch_size, dtype=dtype),
                                                   requires_grad=False)
        self.position_embedding = nn.Module()
        self.position_embedding.weight = nn.Parameter(torch.empty(self.num_positions, hidden, dtype=dtype),
                                                      requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[images, 1 + patches, hidden]`` from ``[images, C, H, W]``."""
        weight = self.patch_embedding.weight
        patches = F.conv2d(pixels.to(weight.dtype), weight, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Heads split across tensor-parallel ranks."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = ColumnParallelLinear(hidden, hidden, bias=True)
        self.k_proj = ColumnParallelLinear(hidden, hidden, bias=True)
        self.v_proj = ColumnParallelLinear(hidden, hidden, bias=True)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=True)
        self.heads = self.q_proj.output_size // self.head_dim  # this rank's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, tokens, hidden = x.shape
        flat = x.reshape(-1, hidden)
        q, k, v = (proj(flat).view(images, tokens, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(images * tokens, -1)
        return self.out_proj(out).view(images, tokens, hidden)


class CLIPMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, intermediate, bias=True)
        self.act = vision_activation(hidden_act)
        self.fc2 = RowParallelLinear(intermediate, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, hidden_act: str, eps: float) -> None:
        super().__init__()
        self.layer_norm1, self.layer_norm2 = LayerNorm(hidden, eps), LayerNorm(hidden, eps)
        self.self_attn = CLIPAttention(hidden, heads)
        self.mlp = CLIPMLP(hidden, intermediate, hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionTower(nn.Module):
    """``CLIPVisionModel``'s ``hidden_states[feature_layer]`` (negative: from the end, as transformers counts
    them: index 0 is the embeddings, ``-1`` the last layer's output). Only the layers it needs are built."""

    def __init__(self, config: dict, feature_layer: int) -> None:
        super().__init__()
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        self.num_run = feature_layer if feature_layer >= 0 else layers + 1 + feature_layer
        if not 0 <= self.num_run <= layers:
            raise ValueError(f"config.json: vision_feature_layer {feature_layer} is out of range for {layers} layers")
        eps = config.get("layer_norm_eps", 1e-5)
        self.embeddings = CLIPEmbeddings(hidden, config["image_size"], config["patch_size"],
                                         config.get("num_channels", 3))
        self.pre_layrnorm = LayerNorm(hidden, eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            CLIPEncoderLayer(hidden, config["num_attention_heads"], config["intermediate_size"],
                             config.get("hidden_act", "quick_gelu"), eps) for _ in range(self.num_run))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            x = layer(x)
        return x

    def skipped(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (relative to the tower) belongs to a part this tower does not run."""
        if name.startswith("post_layernorm."):
            return True
        parts = name.split(".")
        return parts[:2] == ["encoder", "layers"] and int(parts[2]) >= self.num_run
