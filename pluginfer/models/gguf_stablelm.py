"""GGUF files of StableLM (``stablelm``: StableLM-3B-4E1T, StableLM 2): the stablelm spec's ``converters["gguf"]``.

llama.cpp's conventions: LayerNorms with biases; partial rotary (``rope.dimension_count`` of each head);
q/k/v biases when the file has them; a layer with no ``ffn_norm`` runs attention and MLP in parallel off the
input norm (StableLM 2 12B), as llama.cpp's graph does; per-head q/k LayerNorms stacked into one
``[heads, head_dim]`` tensor each (``attn_q_norm`` / ``attn_k_norm``), which the pipeline reads as one.
"""

from __future__ import annotations

from typing import Any

from pluginfer.formats.gguf.checkpoint import GGUFCheckpoint, GGUFModel
from pluginfer.models.gguf_config import decoder_config, linear_scaling, rotary_factor, write_rope

HF_MODULES = (
    "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj", "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.self_attn.q_layernorm", "model.layers.{bid}.self_attn.k_layernorm",
    "model.layers.{bid}.mlp.gate_proj", "model.layers.{bid}.mlp.up_proj", "model.layers.{bid}.mlp.down_proj",
)


def convert(checkpoint: GGUFCheckpoint) -> GGUFModel:
    """The model in a stablelm GGUF file."""
    return GGUFModel(hf_config(checkpoint), HF_MODULES)


def hf_config(checkpoint: GGUFCheckpoint) -> dict:
    config = decoder_config(checkpoint, "StableLmForCausalLM", "stablelm")
    head_dim = config.pop("head_dim")  # the stablelm pipeline's head size is hidden / heads
    if head_dim * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError(f"{checkpoint.path}: attention.key_length {head_dim} is not embedding_length / head_count; "
                         "the stablelm pipeline needs it so")
    config["layer_norm_eps"] = float(checkpoint.field("{arch}.attention.layer_norm_epsilon", 1e-5))
    config["partial_rotary_factor"] = rotary_factor(checkpoint, head_dim)
    config["hidden_act"] = "silu"
    config["use_qkv_bias"] = "blk.0.attn_q.bias" in checkpoint.tensors
    config["qk_layernorm"] = "blk.0.attn_q_norm.weight" in checkpoint.tensors
    config["use_parallel_residual"] = "blk.0.ffn_norm.weight" not in checkpoint.tensors
    if linear_scaling(checkpoint):
        raise ValueError(f"{checkpoint.path}: rope scaling is not supported for stablelm GGUF files")
    return config


def write_hparams(writer: Any, config: dict) -> None:
    """``pluginfer convert``: the keys llama.cpp's converter writes for StableLM beside the common sizes."""
    from pluginfer.layers.rotary import partial_rotary_dim
    from pluginfer.models.stablelm import head_dim_of

    if config.get("qk_layernorm"):
        raise ValueError("qk_layernorm: StableLM's per-head q/k LayerNorms cannot be written to GGUF here")
    writer.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-5)))
    writer.add_parallel_residual(bool(config.get("use_parallel_residual", False)))
    write_rope(writer, config, partial_rotary_dim(config, head_dim_of(config), default_factor=0.25))
