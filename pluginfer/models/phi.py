"""Phi-family pipeline: PhiForCausalLM (Phi-1/1.5/2) and Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4-mini).

Phi-2: LayerNorm, attention and MLP in parallel off one norm, partial rotary, biases everywhere
(the output projection is ``dense``, the LM head has a bias). Phi-3: the llama block with checkpoints
that store ``qkv_proj`` and ``gate_up_proj`` already fused, LongRoPE scaling and an optional sliding window.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import BuildContext, KVCacheSpec
from pluginfer.layers.activation import activation
from pluginfer.layers.attention import bind_kv_caches
from pluginfer.layers.causal_lm import (
    DECODER_SIZE_FIELDS,
    DecoderStack,
    PreNormDecoderLayer,
    check_kv_heads,
    check_positive_fields,
)
from pluginfer.layers.context import current_context
from pluginfer.layers.embedding import LMHead, VocabParallelEmbedding
from pluginfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.norm import LayerNorm, RMSNorm
from pluginfer.layers.rotary import (
    LongRopeEmbedding,
    RotaryEmbedding,
    get_rope,
    partial_rotary_dim,
    rope_parameters,
)
from pluginfer.layers.self_attention import SelfAttention
from pluginfer.layers.weights import load_named_weights

# transformers reads Phi-3's older "su" and "yarn" names as longrope.
_LONGROPE_NAMES = ("longrope", "su", "yarn")


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


class PhiMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden_size, intermediate_size, bias=True)
        self.fc2 = RowParallelLinear(intermediate_size, hidden_size, bias=True)
        self.act = activation(hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


class PhiDecoderLayer(nn.Module):
    def __init__(self, config: dict, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.get("layer_norm_eps", 1e-5)
        hidden, heads, head_dim = config["hidden_size"], config["num_attention_heads"], _head_dim(config)
        qk_norm = bool(config.get("qk_layernorm", False))
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads, head_dim, rope,
                                       qkv_bias=True, output_bias=True,
                                       q_norm=LayerNorm(head_dim, eps) if qk_norm else None,
                                       k_norm=LayerNorm(head_dim, eps) if qk_norm else None)
        self.mlp = PhiMLP(hidden, config["intermediate_size"], config.get("hidden_act", "gelu_new"))
        self.input_layernorm = LayerNorm(hidden, eps)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        return self.self_attn(batch, normed) + self.mlp(normed) + hidden


class PhiModel(nn.Module):
    def __init__(self, config: dict, max_model_len: int) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        rope = get_rope(config, head_dim, partial_rotary_dim(config, head_dim, default_factor=0.5),
                        max_position=max_model_len)
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(PhiDecoderLayer(config, rope) for _ in range(config["num_hidden_layers"]))
        self.final_layernorm = LayerNorm(config["hidden_size"], config.get("layer_norm_eps", 1e-5))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            hidden = layer(batch, hidden)
        return self.final_layernorm(hidden[batch.logits_indices])


def phi3_rope(config: dict, head_dim: int, max_model_len: int) -> RotaryEmbedding:
    """Default rope or LongRoPE (the only scalings transformers' Phi-3 accepts)."""
    rotary_dim = partial_rotary_dim(config, head_dim)
    theta, scaling = rope_parameters(config)
    kind = scaling["rope_type"]
    if kind == "default":
        return get_rope(config, head_dim, rotary_dim, max_position=max_model_len)
    if kind not in _LONGROPE_NAMES:
        raise ValueError(f"config.json: rope_scaling.rope_type {kind!r} is not supported by Phi3ForCausalLM "
                         f"(supported: default, {', '.join(_LONGROPE_NAMES)})")
    max_positions = config.get("max_position_embeddings", 4096)
    # Phi-3 writes its pretraining length at the top level; it wins over the one in rope_scaling.
    original = (config.get("original_max_position_embeddings")
                or scaling.get("original_max_position_embeddings") or max_positions)
    return LongRopeEmbedding(head_dim, rotary_dim, max(max_model_len, max_positions), theta, scaling,
                             original_max_position=original, max_position_embeddings=max_positions,
                             max_model_len=max_model_len)


class Phi3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-5)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads, _head_dim(config),
                                       rope, sliding_window=config.get("sliding_window"))
        self.mlp = GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


def phi3_model(config: dict, max_model_len: int) -> DecoderStack:
    rope = phi3_rope(config, _head_dim(config), max_model_len)
    return DecoderStack(config, lambda _: Phi3DecoderLayer(config, rope), eps_default=1e-5)


class PhiForCausalLM(nn.Module):
    """Both generations: ``model`` (the decoder stack) and ``lm_head``, named as in HF checkpoints."""

    can_generate = True  # ModelPipeline.can_generate: it always has its LM head

    def __init__(self, config: dict, ctx: BuildContext, phi3: bool) -> None:
        super().__init__()
        validate_config(config, phi3)
        self.config, self.phi3 = config, phi3
        self.model = phi3_model(config, ctx.max_model_len) if phi3 else PhiModel(config, ctx.max_model_len)
        self.lm_head = LMHead(config["vocab_size"], config["hidden_size"], bias=not phi3)
        if self.lm_head.bias is not None:
            self.lm_head.bias.weight_loader = self._load_head_bias
        self.tied = bool(config.get("tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie(self.model.embed_tokens)

    def _load_head_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """This rank's slice of the vocabulary, as the head's weight is split."""
        head = self.lm_head
        if tuple(loaded.shape) != (head.vocab_size,):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match expected ({head.vocab_size},)")
        part = loaded[head.start:head.start + head.shard_size]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.model.layers[0].self_attn
        return KVCacheSpec(len(self.model.layers), attn.num_kv_heads, attn.head_dim)

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        bind_kv_caches(self.model, kv_caches)

    def forward(self, batch: ForwardBatch, intermediate: object = None) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Phi-2 names the output projection "dense" and its q/k norms "q_layernorm"/"k_layernorm".
        # Phi-3's fused qkv_proj / gate_up_proj tensors match our parameters and load with shard_id None.
        renames = () if self.phi3 else ((".self_attn.dense.", ".self_attn.o_proj."),
                                        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
                                        (".self_attn.k_layernorm.", ".self_attn.k_norm."))

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if self.tied and name == "lm_head.weight":
                    continue
                for old, new in renames:
                    name = name.replace(old, new)
                yield name, tensor

        load_named_weights(self, renamed(), optional=("lm_head.weight",) if self.tied else ())


def validate_config(config: dict, phi3: bool) -> None:
    """Reject field values this pipeline would otherwise misread."""
    check_positive_fields(config, DECODER_SIZE_FIELDS)
    check_kv_heads(config)
    if phi3 and config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported by Phi3ForCausalLM "
                         "(supported: silu)")


def _build(hf_config: dict, ctx: BuildContext, phi3: bool) -> PhiForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    if ctx.rank.pp_size > 1:
        raise ValueError(f"parallel.pipeline_parallel_size: {ctx.rank.pp_size} stages, but the phi pipeline "
                         "runs its layers on one stage (tensor parallelism works)")
    return PhiForCausalLM(hf_config, ctx, phi3)


def build(hf_config: dict, ctx: BuildContext) -> PhiForCausalLM:
    """PhiForCausalLM or Phi3ForCausalLM, as the config's architectures (or model_type) say."""
    architectures = hf_config.get("architectures") or []
    if "Phi3ForCausalLM" in architectures or hf_config.get("model_type") == "phi3":
        return _build(hf_config, ctx, phi3=True)
    if "PhiForCausalLM" in architectures or hf_config.get("model_type") == "phi":
        return _build(hf_config, ctx, phi3=False)
    raise ValueError(f"config.json: architectures {architectures!r} / model_type {hf_config.get('model_type')!r} "
                     "name no Phi model (supported: PhiForCausalLM, Phi3ForCausalLM)")
