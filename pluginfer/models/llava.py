"""LLaVA pipeline (LlavaForConditionalGeneration: LLaVA-1.5 and its kind): a CLIP tower's patch features,
projected by a two-layer MLP, replace the prompt's ``<image>`` tokens of a Llama decoder.

A request's images arrive as ``ForwardBatch.multimodal[row]`` (a ``LlavaInputs`` made by ``llava_processor``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import BuildContext, IntermediateTensors
from pluginfer.layers.activation import activation
from pluginfer.layers.causal_lm import (
    DECODER_SIZE_FIELDS,
    CausalLM,
    PreNormDecoderLayer,
    check_activation,
    check_kv_heads,
    check_positive_fields,
)
from pluginfer.layers.clip import CLIPVisionTower
from pluginfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.multimodal import EmbeddedDecoder, EncoderCache, with_images
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.layers.self_attention import SelfAttention
from pluginfer.layers.weights import load_named_weights

SELECT_STRATEGIES = ("default", "full")  # drop the class token's feature, or keep it


@dataclass
class LlavaInputs:
    """One request's images, ready for the pipeline."""

    # [images, C, H, W], as the checkpoint's image processor made them
    pixel_values: torch.Tensor
    # [prompt tokens]: row of the image features each token takes, -1 for text
    embed_index: torch.Tensor
    content_hash: bytes


class LlamaLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads, head_dim, rope)
        self.mlp = GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


class Projector(nn.Module):
    """``linear_2(act(linear_1(features)))``: vision width to text width."""

    def __init__(self, vision: int, text: int, hidden_act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(vision, text, bias=bias)
        self.act = activation(hidden_act)
        self.linear_2 = RowParallelLinear(text, text, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(CausalLM):
    def __init__(self, config: dict, ctx: BuildContext) -> None:
        validate_config(config, ctx)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rope = get_rope(config, head_dim, max_position=ctx.max_model_len)
        super().__init__(config, EmbeddedDecoder(config, lambda i: LlamaLayer(config, rope)))
        vision = config["vision_config"]
        self.vision_tower = CLIPVisionTower(vision, int(config.get("vision_feature_layer", -2)))
        self.multi_modal_projector = Projector(vision["hidden_size"], config["hidden_size"],
                                               config.get("projector_hidden_act", "gelu"),
                                               bool(config.get("multimodal_projector_bias", True)))
        self.keep_cls = config.get("vision_feature_select_strategy", "default") == "full"
        self.encoded = EncoderCache(self._encode)

    def _encode(self, inputs: LlavaInputs, device: torch.device) -> torch.Tensor:
        features = self.vision_tower(inputs.pixel_values.to(device))
        if not self.keep_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features.reshape(-1, features.shape[-1]))

    def forward(self, batch: ForwardBatch,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        hidden = self.model.embed_tokens(batch.input_ids)
        if batch.multimodal:
            hidden = with_images(batch, hidden, self.encoded)
        return self.model(batch, hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        towers: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = checkpoint_name(name)
                if name.startswith(("vision_tower.", "multi_modal_projector.")):
                    towers.append((name, tensor))
                elif not (self.tied and name == "lm_head.weight"):  # a tied head may be stored anyway
                    yield name, tensor

        # The decoder's fused routes (q_proj -> qkv_proj) must not reach the tower's own q_proj: separate loads.
        parts = {name: self._modules.pop(name) for name in ("vision_tower", "multi_modal_projector")}
        try:
            load_named_weights(self, text(), optional=("lm_head.",) if self.tied else ())
        finally:
            self._modules.update(parts)
        tower = self.vision_tower
        load_named_weights(nn.ModuleDict(parts), [(n, t) for n, t in towers
                                                  if not tower.skipped(n.removeprefix("vision_tower."))], stacked=())


def checkpoint_name(name: str) -> str:
    """Older (``language_model.model.``) and newer (``model.language_model.``) names, as this pipeline's."""
    for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector."),
                     ("vision_tower.vision_model.", "vision_tower.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def validate_config(config: dict, ctx: BuildContext) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    check_positive_fields(config, DECODER_SIZE_FIELDS)
    check_activation(config, "llava", ("silu",))
    check_kv_heads(config)
    vision = config.get("vision_config")
    if not isinstance(vision, dict) or vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError("config.json: vision_config must be a CLIP vision tower (model_type clip_vision_model)")
    if not isinstance(config.get("vision_feature_layer", -2), int):
        raise ValueError("config.json: vision_feature_layer must be one integer (a list of layers is not supported)")
    if config.get("vision_feature_select_strategy", "default") not in SELECT_STRATEGIES:
        raise ValueError(f"config.json: vision_feature_select_strategy must be one of {SELECT_STRATEGIES}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("config.json: attention_bias / mlp_bias are not supported by the llava pipeline")
    if ctx.rank.pp_size > 1:
        raise ValueError("parallel.pipeline_parallel_size: the llava pipeline runs on one pipeline stage")


def build(hf_config: dict, ctx: BuildContext) -> LlavaForConditionalGeneration:
    return LlavaForConditionalGeneration(hf_config, ctx)
