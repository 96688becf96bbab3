"""Self-attention as most decoder families build it: fused QKV projection, rope, paged attention, output."""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.layers.attention import Attention
from pluginfer.layers.linear import QKVParallelLinear, RowParallelLinear
from pluginfer.layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    """``o_proj(attention(rope(q), rope(k), v))`` with parameters named as HF checkpoints name them.

    ``scale`` defaults to ``head_dim ** -0.5``; ``sliding_window`` limits the keys each query sees.
    ``q_norm`` / ``k_norm`` (optional) normalize ``[tokens, heads, head_dim]`` q and k before rope.
    ``logit_soft_cap``: Gemma-2's ``cap * tanh(scores / cap)`` on the attention scores.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: RotaryEmbedding, qkv_bias: bool = False, output_bias: bool = False,
                 scale: float | None = None, sliding_window: int | None = None,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 logit_soft_cap: float | None = None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=output_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.rotary_emb = rope
        self.q_norm, self.k_norm = q_norm, k_norm
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5 if scale is None else scale,
                              self.num_kv_heads, sliding_window=sliding_window,
                              logit_soft_cap=logit_soft_cap)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split_with_sizes([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        q, k = self.rotary_emb(batch, q, k)
        out = self.attn(batch, q, k, v.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(out)
