"""Qwen2-VL pipeline (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration): the vision tower's
embeddings replace the prompt's image tokens, and the Qwen2 decoder turns its rotary with three position rows
(M-RoPE).

A request's images arrive as ``ForwardBatch.multimodal[row]`` (a ``Qwen2VLInputs`` made by
``qwen2_vl_processor``); the tower runs once per request's images and its output is kept, by content hash,
for the chunks, recomputes and identical requests that follow.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import BuildContext, IntermediateTensors
from pluginfer.layers.causal_lm import (
    DECODER_SIZE_FIELDS,
    CausalLM,
    PreNormDecoderLayer,
    check_activation,
    check_kv_heads,
    check_positive_fields,
)
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.mrope import MROPE_POSITIONS, MRotaryEmbedding
from pluginfer.layers.multimodal import EmbeddedDecoder, EncoderCache, with_images
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import rope_parameters
from pluginfer.layers.self_attention import SelfAttention
from pluginfer.layers.vision import VisionTransformer
from pluginfer.layers.weights import load_named_weights


@dataclass
class Qwen2VLInputs:
    """One request's images, ready for the pipeline (made on the driver, shipped with the step's new rows)."""

    pixel_values: torch.Tensor  # [patches, C*T*P*P], as the checkpoint's image processor made them
    grid_thw: torch.Tensor  # [images, 3]
    positions: torch.Tensor  # [3, prompt tokens]: M-RoPE positions of the prompt
    delta: int  # added to the index of every token after the prompt
    embed_index: torch.Tensor  # [prompt tokens]: row of the image embeddings each token takes, -1 for text
    content_hash: bytes


class Qwen2VLDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, rope: MRotaryEmbedding) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.self_attn = SelfAttention(hidden, heads, config.get("num_key_value_heads") or heads, hidden // heads,
                                       rope, qkv_bias=True)
        self.mlp = GatedMLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


class Qwen2VLForConditionalGeneration(CausalLM):
    def __init__(self, config: dict, ctx: BuildContext) -> None:
        validate_config(config, ctx)
        theta, scaling = rope_parameters(config)
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        rope = MRotaryEmbedding(head_dim, ctx.max_model_len, theta, list(scaling["mrope_section"]))
        super().__init__(config, EmbeddedDecoder(config, lambda i: Qwen2VLDecoderLayer(config, rope)))
        vision = dict(config["vision_config"])
        vision.setdefault("out_hidden_size" if "fullatt_block_indexes" in vision else "hidden_size",
                          config["hidden_size"])
        self.visual = VisionTransformer(vision)
        self.encoded = EncoderCache(lambda inputs, device: self.visual(inputs.pixel_values.to(device),
                                                                       inputs.grid_thw))

    def forward(self, batch: ForwardBatch,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        hidden = self.model.embed_tokens(batch.input_ids)
        if batch.multimodal:
            batch.extras[MROPE_POSITIONS] = self._positions(batch)
            hidden = with_images(batch, hidden, self.encoded)
        return self.model(batch, hidden)

    def _positions(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's [3, tokens] M-RoPE positions: the prompt's from its inputs, later tokens' index + delta."""
        positions = batch.positions.expand(3, -1).clone()
        starts = batch.query_start_loc.tolist()
        for row, inputs in batch.multimodal.items():
            first, end = starts[row], starts[row + 1]
            index = batch.positions[first:end]
            in_prompt = index < inputs.positions.shape[1]
            own = index.expand(3, -1) + inputs.delta
            own[:, in_prompt] = inputs.positions.to(index.device)[:, index[in_prompt]]
            positions[:, first:end] = own
        return positions

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        visual: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterable[tuple[str, torch.Tensor]]:  # transformers' newer names read as the older ones
            for name, tensor in weights:
                name = name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
                if name.startswith("visual."):
                    visual.append((name.removeprefix("visual."), tensor))
                elif not (self.tied and name == "lm_head.weight"):  # a tied head may be stored anyway
                    yield name, tensor

        # The decoder's fused routes (gate_proj -> gate_up_proj) must not reach the tower's own gate_proj:
        # the two load as separate modules.
        tower = self._modules.pop("visual")
        try:
            load_named_weights(self, text(), stacked=self.weight_routes(),
                               optional=("lm_head.",) if self.tied else ())
        finally:
            self._modules["visual"] = tower
        load_named_weights(tower, visual, stacked=())


def validate_config(config: dict, ctx: BuildContext) -> None:
    """Reject fields this pipeline would otherwise ignore."""
    check_positive_fields(config, DECODER_SIZE_FIELDS)
    check_activation(config, "qwen2-vl", ("silu",))
    check_kv_heads(config)
    _, scaling = rope_parameters(config)
    if not scaling.get("mrope_section"):
        raise ValueError("config.json: rope_scaling.mrope_section is missing (the qwen2-vl pipeline needs it)")
    if not isinstance(config.get("vision_config"), dict) or "depth" not in config["vision_config"]:
        raise ValueError("config.json: vision_config (with depth, embed_dim, num_heads) is missing")
    if config.get("use_sliding_window", False):
        raise ValueError("config.json: use_sliding_window is not supported by the qwen2-vl pipeline")
    if ctx.rank.pp_size > 1:
        raise ValueError("parallel.pipeline_parallel_size: the qwen2-vl pipeline runs on one pipeline stage")


def build(hf_config: dict, ctx: BuildContext) -> Qwen2VLForConditionalGeneration:
    return Qwen2VLForConditionalGeneration(hf_config, ctx)
