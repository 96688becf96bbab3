"""DeepSeek-V2 (and V2-Lite) and DeepSeek-V3 (and R1): multi-head latent attention with MoE feed-forwards.

Layer ``i`` holds experts when ``n_routed_experts`` is set, ``i >= first_k_dense_replace`` and
``i % moe_layer_freq == 0`` (DeepSeek's rule; transformers reads only the first two); the others keep a
dense MLP of ``intermediate_size``. A sparse layer adds ``n_shared_experts`` always-on experts (one MLP of
``n_shared_experts * moe_intermediate_size``). Routers: V2 softmax ``greedy`` or ``group_limited_greedy``,
V3 sigmoid ``noaux_tc`` with ``e_score_correction_bias`` (see ``pluginfer.layers.router``).

V2 with ``norm_topk_prob`` follows DeepSeek's own modeling code (normalize, then no routed scaling);
transformers' V2 ignores ``norm_topk_prob``. Every released V2 checkpoint has it off, where both agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from pluginfer.core.protocols import BuildContext, KVCacheSpec
from pluginfer.layers.causal_lm import (
    CausalLM,
    DecoderStack,
    PreNormDecoderLayer,
    check_activation,
    check_positive_fields,
)
from pluginfer.layers.context import current_context
from pluginfer.layers.mla import MultiHeadLatentAttention
from pluginfer.layers.mlp import GatedMLP, check_tp_divisible
from pluginfer.layers.moe import SparseMoeBlock, expert_weight_names
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import (
    RotaryEmbedding,
    YarnRotaryEmbedding,
    rope_parameters,
    yarn_factor,
    yarn_mscale,
)
from pluginfer.layers.router import RouterSpec, validate_router_config

# transformers' config defaults for fields a DeepSeek config.json may leave out.
_DEFAULTS = {
    "v2": {"n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "greedy", "norm_topk_prob": False,
           "first_k_dense_replace": 0, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64},
    "v3": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "norm_topk_prob": True,
           "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
           "rope_interleave": True},
}
_METHODS = {"v2": ("greedy", "group_limited_greedy"), "v3": ("noaux_tc",)}
_SUPPORTED_ACTIVATIONS = ("silu",)
_SUPPORTED_ROPE_TYPES = ("default", "yarn")
_MLP_ROUTES = ((".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1))
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def version_of(config: dict) -> str:
    names = [*(config.get("architectures") or []), config.get("model_type") or ""]
    return "v3" if any("V3" in name or name == "deepseek_v3" for name in names) else "v2"


_NULL_MEANS_NONE = ("q_lora_rank", "n_routed_experts")  # null is a choice here (plain q_proj, a dense model)


def with_defaults(config: dict) -> dict:
    given = {k: v for k, v in config.items() if v is not None or k in _NULL_MEANS_NONE}
    return {**_DEFAULTS[version_of(config)], **given}


def sparse_layers(config: dict) -> list[bool]:
    experts, first_dense, freq = (config.get("n_routed_experts"), config.get("first_k_dense_replace") or 0,
                                  config.get("moe_layer_freq", 1))
    return [experts is not None and i >= first_dense and i % freq == 0 for i in range(config["num_hidden_layers"])]


def router_spec(config: dict) -> RouterSpec:
    version, normalize = version_of(config), bool(config["norm_topk_prob"])
    scaling = float(config["routed_scaling_factor"])
    if version == "v2" and normalize:
        scaling = 1.0  # DeepSeek-V2's code scales only the unnormalized weights
    method = config.get("topk_method") or _DEFAULTS[version]["topk_method"]
    grouped = method != "greedy"
    return RouterSpec(top_k=config.get("num_experts_per_tok", 2), renormalize=normalize, topk_method=method,
                      num_groups=config["n_group"] if grouped else 1, topk_groups=config["topk_group"] if grouped else 1,
                      routed_scaling_factor=scaling, correction_bias=version == "v3")


def build_rope(config: dict, max_model_len: int) -> tuple[RotaryEmbedding, float]:
    """The rope of the ``qk_rope_head_dim`` part and the softmax scale (times YaRN's mscale² as transformers)."""
    theta, scaling = rope_parameters(config)
    dim = config["qk_rope_head_dim"]
    native = config.get("max_position_embeddings", 2048)
    positions = max(max_model_len, native)
    # V2 rotates adjacent pairs; V3 too unless rope_interleave is off (then the neox halves).
    neox = version_of(config) == "v3" and not config.get("rope_interleave", True)
    scale = (config["qk_nope_head_dim"] + dim) ** -0.5
    if scaling["rope_type"] == "yarn":
        rope = YarnRotaryEmbedding(dim, dim, positions, theta, scaling, native, is_neox_style=neox)
        if scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(yarn_factor(scaling, native)[0], scaling["mscale_all_dim"])
            scale *= mscale * mscale
        return rope, scale
    return RotaryEmbedding(dim, dim, positions, theta, is_neox_style=neox), scale


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, rope: RotaryEmbedding, scale: float, sparse: bool) -> None:
        super().__init__()
        hidden, eps, act = config["hidden_size"], config.get("rms_norm_eps", 1e-6), config.get("hidden_act", "silu")
        self.self_attn = MultiHeadLatentAttention(
            hidden, config["num_attention_heads"], config.get("q_lora_rank"), config["kv_lora_rank"],
            config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"], rope, scale,
            bias=bool(config.get("attention_bias", False)))
        if sparse:
            # Tensor parallelism splits the routed and the shared experts' intermediate dimension.
            moe_size, shared = config["moe_intermediate_size"], config.get("n_shared_experts") or 0
            check_tp_divisible(moe_size, "moe_intermediate_size")
            shared_mlp = GatedMLP(hidden, moe_size * shared, act,
                                  size_field="n_shared_experts * moe_intermediate_size") if shared else None
            self.mlp = SparseMoeBlock(config["n_routed_experts"], config.get("num_experts_per_tok", 2), hidden,
                                      moe_size, renormalize=False, hidden_act=act, router=router_spec(config),
                                      shared_experts=shared_mlp, size_field="moe_intermediate_size")
        else:
            self.mlp = GatedMLP(hidden, config["intermediate_size"], act)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


class DeepseekForCausalLM(CausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (the variant is read from the config)."""

    def __init__(self, config: dict, ctx: BuildContext) -> None:
        config = with_defaults(config)
        validate_config(config)
        rope, scale = build_rope(config, ctx.max_model_len)
        sparse = sparse_layers(config)
        stack = DecoderStack(config, lambda i: DeepseekDecoderLayer(config, rope, scale, sparse[i]))
        super().__init__(config, stack)

    def kv_cache_spec(self) -> KVCacheSpec:
        held = self.model.held_layers()
        attn = held[0].self_attn
        return KVCacheSpec(len(held), 1, attn.kv_lora_rank + attn.rope_dim,
                           value_in_key=attn.kv_lora_rank)

    def weight_routes(self) -> tuple:
        # Expert names first: the dense ".gate_proj." route would also match "experts.{e}.gate_proj.".
        experts = self.config.get("n_routed_experts") or 0
        return expert_weight_names(experts, "gate_proj", "up_proj", "down_proj") + _MLP_ROUTES

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Multi-token-prediction layers (num_nextn_predict_layers) sit past the last layer: not served.
        layers = self.config["num_hidden_layers"]
        super().load_weights((name, tensor) for name, tensor in weights
                             if not ((match := _LAYER.match(name)) and int(match.group(1)) >= layers))


def validate_config(config: dict) -> None:
    """Reject fields this pipeline would otherwise ignore, naming the field and its value."""
    version = version_of(config)
    check_positive_fields(config, ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                                   "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_lora = config.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise ValueError(f"config.json: q_lora_rank must be a positive integer or null, got {q_lora!r}")
    kv_heads = config.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != config["num_attention_heads"]:
        raise ValueError(f"config.json: num_key_value_heads = {kv_heads!r} must equal num_attention_heads "
                         f"{config['num_attention_heads']} (latent attention expands keys for every head)")
    if config.get("mlp_bias"):
        raise ValueError(f"config.json: mlp_bias = {config['mlp_bias']!r} is not supported")
    freq = config.get("moe_layer_freq", 1)
    if not isinstance(freq, int) or freq <= 0:
        raise ValueError(f"config.json: moe_layer_freq must be a positive integer, got {freq!r}")
    first_dense = config.get("first_k_dense_replace") or 0
    if not isinstance(first_dense, int) or first_dense < 0:
        raise ValueError(f"config.json: first_k_dense_replace must be a non-negative integer, got {first_dense!r}")
    sparse = sparse_layers(config)
    if any(sparse):
        validate_router_config(config, config["n_routed_experts"], "n_routed_experts", methods=_METHODS[version],
                               default_method=_DEFAULTS[version]["topk_method"])
    for field, needed in (("moe_intermediate_size", any(sparse)), ("intermediate_size", not all(sparse))):
        if needed and (not isinstance(config.get(field), int) or config[field] <= 0):
            raise ValueError(f"config.json: {field} must be a positive integer, got {config.get(field)!r}")
    check_activation(config, f"deepseek-{version}", _SUPPORTED_ACTIVATIONS)
    _, scaling = rope_parameters(config)
    if scaling["rope_type"] not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type: unsupported value {scaling['rope_type']!r} "
                         f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})")
    if config["qk_rope_head_dim"] % 2:
        raise ValueError(f"config.json: qk_rope_head_dim must be even, got {config['qk_rope_head_dim']!r}")


def build(hf_config: dict, ctx: BuildContext) -> DeepseekForCausalLM:
    assert current_context() is ctx, "build the pipeline inside pluginfer.layers.context.building(ctx)"
    return DeepseekForCausalLM(hf_config, ctx)
