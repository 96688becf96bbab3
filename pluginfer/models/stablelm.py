"""StableLM pipeline (StableLmForCausalLM: StableLM-3B-4E1T, StableLM 2).

LayerNorm (with bias) instead of RMSNorm, neox rope on the first ``partial_rotary_factor``
(default 0.25) of each head, and, as the config says: q/k/v bias (``use_qkv_bias``), a
LayerNorm per head on q and k (``qk_layernorm``), and GPT-NeoX's parallel residual
(``use_parallel_residual``: attention and MLP both read the same normed input).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import BuildContext
from pluginfer.layers.causal_lm import (
    DECODER_SIZE_FIELDS,
    CausalLM,
    DecoderStack,
    check_activation,
    check_kv_heads,
    check_positive_fields,
)
from pluginfer.layers.context import current_context
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.norm import LayerNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope, partial_rotary_dim
from pluginfer.layers.self_attention import SelfAttention


def head_dim_of(config: dict) -> int:
    return config["hidden_size"] // config["num_attention_heads"]


class LayerNormPerHead(nn.Module):
    """One bias-free LayerNorm per head over ``[tokens, heads, head_dim]`` (``norms.<i>.weight`` as HF names them).

    Every head's weight is held; this rank uses the ``num_local`` heads from ``first``.
    """

    def __init__(self, head_dim: int, num_heads: int, eps: float, first: int, num_local: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(LayerNorm(head_dim, eps, bias=False) for _ in range(num_heads))
        self.eps, self.first, self.num_local = eps, first, num_local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.stack([norm.weight for norm in self.norms[self.first:self.first + self.num_local]])
        out = F.layer_norm(x.float(), x.shape[-1:], eps=self.eps) * weight.float()
        return out.to(x.dtype)


def _qk_layernorms(config: dict, head_dim: int) -> tuple[LayerNormPerHead, LayerNormPerHead]:
    """The q and k per-head norms for this rank's heads (KV heads may be replicated across ranks)."""
    collective = current_context().collective
    rank, tp_size = collective.rank, collective.world_size
    heads, eps = config["num_attention_heads"], config.get("layer_norm_eps", 1e-5)
    kv_heads = config.get("num_key_value_heads") or heads
    local_heads, local_kv = heads // tp_size, max(1, kv_heads // tp_size)
    kv_rank = rank // max(1, tp_size // kv_heads)
    return (LayerNormPerHead(head_dim, heads, eps, rank * local_heads, local_heads),
            LayerNormPerHead(head_dim, kv_heads, eps, kv_rank * local_kv, local_kv))


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config: dict, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.get("layer_norm_eps", 1e-5)
        hidden, heads, head_dim = config["hidden_size"], config["num_attention_heads"], head_dim_of(config)
        q_norm, k_norm = _qk_layernorms(config, head_dim) if config.get("qk_layernorm", False) else (None, None)
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads, head_dim, rope,
                                       qkv_bias=bool(config.get("use_qkv_bias", False)), q_norm=q_norm,
                                       k_norm=k_norm)
        self.mlp = GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"))
        self.input_layernorm = LayerNorm(hidden, eps)
        self.parallel_residual = bool(config.get("use_parallel_residual", False))
        if not self.parallel_residual:
            self.post_attention_layernorm = LayerNorm(hidden, eps)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attention = self.self_attn(batch, hidden)
        if self.parallel_residual:  # x + attn(ln(x)) + mlp(ln(x))
            return attention + self.mlp(hidden), residual
        hidden, residual = self.post_attention_layernorm(attention, residual)
        return self.mlp(hidden), residual


class StableLmForCausalLM(CausalLM):
    def __init__(self, config: dict, ctx: BuildContext) -> None:
        validate_config(config)
        head_dim = head_dim_of(config)
        rope = get_rope(config, head_dim, rotary_dim=partial_rotary_dim(config, head_dim, default_factor=0.25),
                        max_position=ctx.max_model_len)
        final_norm = LayerNorm(config["hidden_size"], config.get("layer_norm_eps", 1e-5))
        super().__init__(config, DecoderStack(config, lambda _: StableLmDecoderLayer(config, rope), norm=final_norm))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # HF's self_attn.{q,k}_layernorm are SelfAttention's q_norm / k_norm here.
        super().load_weights((name.replace(".q_layernorm.", ".q_norm.").replace(".k_layernorm.", ".k_norm."), tensor)
                             for name, tensor in _per_head_norms(weights))


def _per_head_norms(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """A ``[heads, head_dim]`` stack of the per-head q/k norms (GGUF files hold them so) as HF's ``norms.<i>``."""
    for name, tensor in weights:
        if name.endswith(("self_attn.q_layernorm.weight", "self_attn.k_layernorm.weight")) and tensor.dim() == 2:
            prefix = name.removesuffix("weight")
            yield from ((f"{prefix}norms.{head}.weight", row) for head, row in enumerate(tensor))
        else:
            yield name, tensor


_SUPPORTED_ACTIVATIONS = ("silu",)


def validate_config(config: dict) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    check_positive_fields(config, DECODER_SIZE_FIELDS)
    check_activation(config, "stablelm", _SUPPORTED_ACTIVATIONS)
    check_kv_heads(config)
    heads = config["num_attention_heads"]
    if config["hidden_size"] % heads:
        raise ValueError(f"config.json: hidden_size {config['hidden_size']} is not a multiple of "
                         f"num_attention_heads {heads}")


def build(hf_config: dict, ctx: BuildContext) -> StableLmForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return StableLmForCausalLM(hf_config, ctx)
