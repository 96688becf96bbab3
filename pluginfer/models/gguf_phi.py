"""GGUF files of Phi-2 (``phi2``) and Phi-3 / Phi-3.5 / Phi-4-mini (``phi3``): the phi spec's ``converters["gguf"]``.

llama.cpp's conventions:
- Phi-2: LayerNorms with biases, separate q/k/v (or, from older converters, one ``attn_qkv``), an LM head
  with a bias, partial rotary (``rope.dimension_count``); its ``feed_forward_length`` is written as
  ``4 * hidden`` whatever the checkpoint, so the MLP width is read from ``ffn_up``'s shape.
- Phi-3: the checkpoint's fused ``qkv_proj`` and ``gate_up_proj`` are kept fused (``attn_qkv``, and
  ``ffn_up`` of twice the MLP width); LongRoPE's factors are the ``rope_factors_long`` / ``rope_factors_short``
  tensors with the pretraining length in ``rope.scaling.original_context_length``; ``attention.sliding_window``
  0 means none (Phi-4-mini).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pluginfer.formats.gguf.checkpoint import GGUFCheckpoint, GGUFModel
from pluginfer.models.gguf_config import decoder_config, linear_scaling, rotary_factor, rows_of

_LONG, _SHORT = "rope_factors_long.weight", "rope_factors_short.weight"

PHI2_MODULES = (
    "model.embed_tokens", "model.final_layernorm", "lm_head", "model.layers.{bid}.input_layernorm",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj", "model.layers.{bid}.self_attn.qkv_proj",
    "model.layers.{bid}.self_attn.dense", "model.layers.{bid}.mlp.fc1", "model.layers.{bid}.mlp.fc2",
)
PHI3_MODULES = (
    "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.qkv_proj", "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.k_proj",  # llama.cpp reads these too
    "model.layers.{bid}.self_attn.v_proj",
    "model.layers.{bid}.mlp.gate_up_proj", "model.layers.{bid}.mlp.down_proj",
)


def convert(checkpoint: GGUFCheckpoint) -> GGUFModel:
    """The model in a phi2/phi3 GGUF file."""
    if checkpoint.arch == "phi2":
        return GGUFModel(phi2_config(checkpoint), PHI2_MODULES)
    return GGUFModel(phi3_config(checkpoint), PHI3_MODULES, ignored_tensors=(_LONG, _SHORT))


def phi2_config(checkpoint: GGUFCheckpoint) -> dict:
    config = decoder_config(checkpoint, "PhiForCausalLM", "phi")
    # the phi pipeline's head size is hidden / heads, as Phi-2's config has it
    config.pop("head_dim")
    config["intermediate_size"] = rows_of(checkpoint, "blk.0.ffn_up.weight")
    config["layer_norm_eps"] = float(checkpoint.field("{arch}.attention.layer_norm_epsilon", 1e-5))
    config["partial_rotary_factor"] = rotary_factor(checkpoint, config["hidden_size"] // config["num_attention_heads"])
    config["hidden_act"] = "gelu_new"
    if linear_scaling(checkpoint):
        raise ValueError(f"{checkpoint.path}: rope scaling is not supported for phi2 GGUF files")
    return config


def phi3_config(checkpoint: GGUFCheckpoint) -> dict:
    config = decoder_config(checkpoint, "Phi3ForCausalLM", "phi3")
    config["rms_norm_eps"] = float(checkpoint.field("{arch}.attention.layer_norm_rms_epsilon", 1e-5))
    config["partial_rotary_factor"] = rotary_factor(checkpoint, config["head_dim"])
    config["hidden_act"] = "silu"
    window = checkpoint.field("{arch}.attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    original = checkpoint.field("{arch}.rope.scaling.original_context_length")
    if original:
        config["original_max_position_embeddings"] = int(original)
    if _LONG in checkpoint.tensors or _SHORT in checkpoint.tensors:
        config["rope_scaling"] = {"rope_type": "longrope", "long_factor": _factors(checkpoint, _LONG),
                                  "short_factor": _factors(checkpoint, _SHORT)}
    elif linear_scaling(checkpoint):
        raise ValueError(f"{checkpoint.path}: rope scaling other than LongRoPE's factor tensors is not supported "
                         "for phi3 GGUF files")
    return config


def _factors(checkpoint: GGUFCheckpoint, name: str) -> list[float]:
    if name not in checkpoint.tensors:
        raise ValueError(f"{checkpoint.path}: LongRoPE needs both {_LONG!r} and {_SHORT!r}; {name!r} is missing")
    tensor = checkpoint.tensors[name]
    if tensor.tensor_type.name != "F32":
        raise ValueError(f"{checkpoint.path}: tensor {name!r} is {tensor.tensor_type.name}; llama.cpp reads it as F32")
    return np.array(tensor.data, dtype=np.float32).reshape(-1).tolist()


def write_hparams(writer: Any, config: dict) -> None:
    """``pluginfer convert``: the keys llama.cpp's converter writes for Phi-2 / Phi-3 beside the common sizes."""
    import gguf

    from pluginfer.layers.rotary import partial_rotary_dim, rope_parameters
    from pluginfer.models.gguf_config import write_rope

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if writer.arch == "phi2":
        writer.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-5)))
        write_rope(writer, config, partial_rotary_dim(config, head_dim, default_factor=0.5))
        return
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    theta, scaling = rope_parameters(config)
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(partial_rotary_dim(config, head_dim))
    writer.add_sliding_window(int(config.get("sliding_window") or 0))  # 0: none, as llama.cpp writes it
    original = config.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    if original:
        writer.add_rope_scaling_orig_ctx_len(int(original))
    if scaling["rope_type"] in ("longrope", "su"):
        given = [key for key in ("factor", "attention_factor") if scaling.get(key) is not None]
        if given:
            # the reader computes both from the context lengths, as transformers does by default
            raise ValueError(f"rope_scaling: longrope with {', '.join(given)} cannot be written to GGUF here")
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        writer.add_tensor(_LONG, np.array(scaling["long_factor"], dtype=np.float32))
        writer.add_tensor(_SHORT, np.array(scaling["short_factor"], dtype=np.float32))
    elif scaling["rope_type"] != "default":
        raise ValueError(f"rope scaling {scaling['rope_type']!r} cannot be written to a phi3 GGUF file here "
                         "(supported: longrope)")
