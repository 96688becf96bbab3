"""Multi-head latent attention (DeepSeek-V2/V3): the paged cache holds one compressed latent per token.

A token's cache row is its ``kv_lora_rank`` latent and the shared rotated key, one "head" read as key and
value. Attention runs absorbed for prefill and decode: queries go into latent space through ``W_UK``, the
weighted latent comes back through ``W_UV``; no per-head key or value is materialised. Tensor parallelism
splits the heads (one all-reduce per layer); the latent cache is replicated on every rank, as vLLM does.
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.layers.attention import Attention
from pluginfer.layers.context import current_context
from pluginfer.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding

# transformers builds q_a_layernorm / kv_a_layernorm with its RMSNorm default, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: ``weight`` ``[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``, this rank's heads.

    Held as a plain dense tensor (never through a QuantMethod): its per-head slices are the absorbed
    ``W_UK`` and ``W_UV``, used in batched matmuls rather than as one linear layer.
    """

    def __init__(self, kv_lora_rank: int, num_heads: int, nope_dim: int, v_dim: int) -> None:
        super().__init__()
        ctx = current_context()
        self.rank, self.world = ctx.collective.rank, ctx.collective.world_size
        self.num_heads, self.nope_dim, self.v_dim = num_heads, nope_dim, v_dim
        rows = num_heads * (nope_dim + v_dim)
        self.weight = nn.Parameter(torch.empty(rows, kv_lora_rank, dtype=ctx.dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """The checkpoint holds every head's rows, head by head; this rank copies its heads' block."""
        rows = param.shape[0]
        full = (rows * self.world, param.shape[1])
        if tuple(loaded.shape) != full:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match expected {full}")
        param.data.copy_(loaded.narrow(0, self.rank * rows, rows))

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``W_UK`` ``[heads, nope, kv_lora_rank]``, ``W_UV`` ``[heads, v, kv_lora_rank]``): views, no copies."""
        per_head = self.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return per_head[:, :self.nope_dim], per_head[:, self.nope_dim:]


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's attention with parameters named as its checkpoints name them.

    ``q_lora_rank`` None: a plain ``q_proj`` (DeepSeek-V2-Lite); else ``q_a_proj`` -> ``q_a_layernorm`` ->
    ``q_b_proj``. ``rope`` rotates the ``qk_rope_head_dim`` part (DeepSeek's interleaved pairs or halves,
    as the family's config says). ``scale``: the softmax scale (``qk_head_dim ** -0.5``, times YaRN's mscale²).
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope: RotaryEmbedding,
                 scale: float, bias: bool = False) -> None:
        super().__init__()
        world = current_context().collective.world_size
        if num_heads % world:
            raise ValueError(f"config.json: num_attention_heads {num_heads} is not divisible by the tensor-parallel "
                             f"size {world} (parallel.tensor_parallel_size)")
        self.num_heads = num_heads // world
        self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim = (kv_lora_rank, qk_nope_head_dim,
                                                                      qk_rope_head_dim, v_head_dim)
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * qk_head_dim)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(kv_lora_rank, self.num_heads, qk_nope_head_dim, v_head_dim)
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.rotary_emb = rope
        # One cache head of rope key + latent; the value is the latent (its last kv_lora_rank features).
        self.attn = Attention(self.num_heads, kv_lora_rank + qk_rope_head_dim, scale, num_kv_heads=1)
        self.num_kv_heads, self.head_dim = 1, kv_lora_rank + qk_rope_head_dim

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self.rotary_emb(batch, q_rope.contiguous(), k_rope.reshape(tokens, 1, self.rope_dim))
        w_uk, w_uv = self.kv_b_proj.absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [heads, tokens, kv_lora_rank]
        query = torch.cat((q_rope, q_latent.transpose(0, 1)), dim=-1)
        key = torch.cat((k_rope.reshape(tokens, self.rope_dim), latent), dim=-1).unsqueeze(1)
        out_latent = self.attn(batch, query, key, None).view(tokens, self.num_heads, self.kv_lora_rank)
        out = torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2))  # [heads, tokens, v_head_dim]
        return self.o_proj(out.transpose(0, 1).reshape(tokens, self.num_heads * self.v_dim))
