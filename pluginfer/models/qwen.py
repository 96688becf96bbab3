"""Qwen pipeline: Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM (per-head q/k RMSNorm).

Both have the Llama block; both may put a sliding window on some layers (``use_sliding_window``
with ``max_window_layers``, or an explicit ``layer_types`` list).
"""

from __future__ import annotations

from pluginfer.core.protocols import BuildContext
from pluginfer.layers.causal_lm import (
    DECODER_SIZE_FIELDS,
    CausalLM,
    DecoderStack,
    PreNormDecoderLayer,
    check_activation,
    check_kv_heads,
    check_positive_fields,
)
from pluginfer.layers.context import current_context
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.layers.self_attention import SelfAttention

LAYER_TYPES = ("full_attention", "sliding_attention")


def head_dim_of(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


class QwenDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, rope: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        hidden, heads, head_dim = config["hidden_size"], config["num_attention_heads"], head_dim_of(config)
        qwen3 = variant(config) == "qwen3"
        # Qwen2 always has q/k/v bias and no output bias; Qwen3 has attention_bias on all four.
        qkv_bias = bool(config.get("attention_bias", False)) if qwen3 else True
        output_bias = bool(config.get("attention_bias", False)) if qwen3 else False
        q_norm = RMSNorm(head_dim, eps) if qwen3 else None
        k_norm = RMSNorm(head_dim, eps) if qwen3 else None
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads, head_dim, rope,
                                       qkv_bias=qkv_bias, output_bias=output_bias, sliding_window=sliding_window,
                                       q_norm=q_norm, k_norm=k_norm)
        self.mlp = GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)



class QwenForCausalLM(CausalLM):
    def __init__(self, config: dict, ctx: BuildContext) -> None:
        validate_config(config)
        rope = get_rope(config, head_dim_of(config), max_position=ctx.max_model_len, yarn=True)
        windows = layer_sliding_windows(config)
        super().__init__(config, DecoderStack(config, lambda i: QwenDecoderLayer(config, rope, windows[i])))


def layer_sliding_windows(config: dict) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers' Qwen2/Qwen3 configs decide."""
    layers = config["num_hidden_layers"]
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    if config.get("use_sliding_window", False) and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"config.json: sliding_window must be a positive integer when use_sliding_window is "
                         f"true, got {window!r}")
    layer_types = config.get("layer_types")
    if layer_types is None:
        first_sliding = config.get("max_window_layers", layers)
        layer_types = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                       for i in range(layers)]
    if len(layer_types) != layers:
        raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for {layers} layers")
    for kind in layer_types:
        if kind not in LAYER_TYPES:
            raise ValueError(f"config.json: layer_types value {kind!r} is not supported by the qwen pipeline "
                             f"(supported: {', '.join(LAYER_TYPES)})")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


VARIANTS = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "qwen2": "qwen2", "qwen3": "qwen3"}
_SUPPORTED_ACTIVATIONS = ("silu",)


def variant(config: dict) -> str:
    """"qwen2" or "qwen3", from config.json's architectures (else its model_type)."""
    for name in [*(config.get("architectures") or []), config.get("model_type")]:
        if name in VARIANTS:
            return VARIANTS[name]
    raise ValueError(f"config.json: architectures {config.get('architectures')!r} / model_type "
                     f"{config.get('model_type')!r} name no architecture of the qwen pipeline "
                     f"(supported: Qwen2ForCausalLM, Qwen3ForCausalLM)")


def validate_config(config: dict) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    variant(config)
    check_positive_fields(config, DECODER_SIZE_FIELDS)
    check_activation(config, "qwen", _SUPPORTED_ACTIVATIONS)
    check_kv_heads(config)
    layer_sliding_windows(config)


def build(hf_config: dict, ctx: BuildContext) -> QwenForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return QwenForCausalLM(hf_config, ctx)
