"""GGUF files of GLM-4 (``glm4``, GLM-4-0414): the glm4 spec's ``converters["gguf"]``.

llama.cpp's conventions: the checkpoint's fused ``gate_up_proj`` stays fused (``ffn_up`` of twice the MLP
width); the norms after attention and after the MLP are ``post_attention_norm`` and ``post_ffw_norm`` (the
norm before the MLP is ``ffn_norm``); q/k/v biases; GPT-J style rope on ``rope.dimension_count`` of each head
(the q/k rows are left in the checkpoint's order; only M-RoPE files, GLM-4V, are permuted, and those are not
read here).
"""

from __future__ import annotations

from typing import Any

from pluginfer.formats.gguf.checkpoint import GGUFCheckpoint, GGUFModel
from pluginfer.models.gguf_config import decoder_config, linear_scaling, rotary_factor, write_rope

HF_MODULES = (
    "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_self_attn_layernorm",
    "model.layers.{bid}.post_attention_layernorm", "model.layers.{bid}.post_mlp_layernorm",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj", "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.self_attn.qkv_proj",  # llama.cpp reads a fused attn_qkv too
    "model.layers.{bid}.mlp.gate_up_proj", "model.layers.{bid}.mlp.down_proj",
)


def convert(checkpoint: GGUFCheckpoint) -> GGUFModel:
    """The model in a glm4 GGUF file."""
    return GGUFModel(hf_config(checkpoint), HF_MODULES)


def hf_config(checkpoint: GGUFCheckpoint) -> dict:
    if checkpoint.field("{arch}.rope.dimension_sections") is not None:
        raise ValueError(f"{checkpoint.path}: a glm4 GGUF file with M-RoPE sections (GLM-4V) is not supported; "
                         "the glm4 pipeline is text-only")
    config = decoder_config(checkpoint, "Glm4ForCausalLM", "glm4")
    config["rms_norm_eps"] = float(checkpoint.field("{arch}.attention.layer_norm_rms_epsilon", 1e-5))
    config["partial_rotary_factor"] = rotary_factor(checkpoint, config["head_dim"])
    config["attention_bias"] = "blk.0.attn_q.bias" in checkpoint.tensors
    config["hidden_act"] = "silu"
    if linear_scaling(checkpoint):
        raise ValueError(f"{checkpoint.path}: rope scaling is not supported for glm4 GGUF files")
    return config


def write_hparams(writer: Any, config: dict) -> None:
    """``pluginfer convert``: the keys llama.cpp's converter writes for GLM-4 beside the common sizes."""
    from pluginfer.layers.rotary import partial_rotary_dim
    from pluginfer.models.glm4 import head_dim_of

    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    write_rope(writer, config, partial_rotary_dim(config, head_dim_of(config), default_factor=0.5))
