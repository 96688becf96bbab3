"""GGUF files of Gemma 1, 2 and 3 (``gemma``, ``gemma2``, ``gemma3``): the gemma spec's ``converters["gguf"]``.

llama.cpp stores RMSNorm weights as ``1 + w`` (the pipeline adds the 1 itself, so it is taken off at load);
Gemma 2 alternates sliding-window layers and soft-caps, Gemma 3 has one full-attention layer in 6 and a
local rope base (``rope.freq_base_swa``); the 27B models scale queries by ``hidden / heads``; the head is
tied to the embedding. Defaults are llama.cpp's where a key is missing.
"""

from __future__ import annotations

from typing import Any

import torch

from pluginfer.formats.gguf.checkpoint import GGMLTensor, GGUFCheckpoint, GGUFModel
from pluginfer.models.gguf_config import decoder_config, linear_scaling

SLIDING, FULL = "sliding_attention", "full_attention"
_ARCHITECTURES = {"gemma": ("GemmaForCausalLM", "gemma"), "gemma2": ("Gemma2ForCausalLM", "gemma2"),
                  "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales the 27B models' queries by hidden / heads
_PATTERN = {"gemma2": 2, "gemma3": 6}

HF_MODULES = (
    "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.pre_feedforward_layernorm", "model.layers.{bid}.post_feedforward_layernorm",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj", "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.self_attn.q_norm", "model.layers.{bid}.self_attn.k_norm",
    "model.layers.{bid}.mlp.gate_proj", "model.layers.{bid}.mlp.up_proj", "model.layers.{bid}.mlp.down_proj",
)


def convert(checkpoint: GGUFCheckpoint) -> GGUFModel:
    """The model in a gemma/gemma2/gemma3 GGUF file."""
    return GGUFModel(hf_config(checkpoint), HF_MODULES, fix=_norm_without_offset)


def hf_config(checkpoint: GGUFCheckpoint) -> dict:
    """The config.json of the same Gemma model, as llama.cpp reads the file."""
    architecture, model_type = _ARCHITECTURES[checkpoint.arch]
    config = decoder_config(checkpoint, architecture, model_type)
    config["rms_norm_eps"] = float(checkpoint.field("{arch}.attention.layer_norm_rms_epsilon", 1e-6))
    config["hidden_act" if checkpoint.arch == "gemma" else "hidden_activation"] = "gelu_pytorch_tanh"
    if checkpoint.arch == "gemma":
        if linear_scaling(checkpoint):
            raise ValueError(f"{checkpoint.path}: rope scaling is not supported for gemma GGUF files")
        return config
    layers = config["num_hidden_layers"]
    if layers == _LAYERS_27B[checkpoint.arch]:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = config["head_dim"]
    window = checkpoint.field("{arch}.attention.sliding_window")
    if checkpoint.arch == "gemma2":
        config["sliding_window"] = int(window or 4096)
        config["attn_logit_softcapping"] = float(checkpoint.field("{arch}.attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = float(checkpoint.field("{arch}.final_logit_softcapping", 30.0))
        local_base = checkpoint.field("{arch}.rope.freq_base_swa")
        if local_base is not None and float(local_base) != config["rope_theta"]:
            raise ValueError(f"{checkpoint.path}: rope.freq_base_swa {local_base} differs from rope.freq_base; the "
                             "gemma2 pipeline has one rope base")
        if linear_scaling(checkpoint):
            raise ValueError(f"{checkpoint.path}: rope scaling is not supported for gemma2 GGUF files")
        config["layer_types"] = _layer_types(checkpoint, layers)
        return config
    final_cap = checkpoint.field("{arch}.final_logit_softcapping")
    if final_cap:
        config["final_logit_softcapping"] = float(final_cap)
    if window:
        config["sliding_window"] = int(window)
        config["layer_types"] = _layer_types(checkpoint, layers)
    else:
        config["layer_types"] = [FULL] * layers
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta"), **(linear_scaling(checkpoint) or {})}
    local = {"rope_type": "default", "rope_theta": float(checkpoint.field("{arch}.rope.freq_base_swa", 10000.0))}
    config["rope_parameters"] = {FULL: full, SLIDING: local}
    return config


def _layer_types(checkpoint: GGUFCheckpoint, layers: int) -> list[str]:
    """llama.cpp's sliding layers: the pattern key as a per-layer array, or a period whose last layer is full."""
    pattern = checkpoint.field("{arch}.attention.sliding_window_pattern", _PATTERN[checkpoint.arch])
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise ValueError(f"{checkpoint.path}: attention.sliding_window_pattern lists {len(pattern)} layers, "
                             f"the model has {layers}")
        return [SLIDING if is_sliding else FULL for is_sliding in pattern]
    period = int(pattern)
    return [SLIDING if period == 0 or layer % period < period - 1 else FULL for layer in range(layers)]


def _norm_without_offset(hf_name: str, loaded: Any) -> Any:
    """llama.cpp stores Gemma's RMSNorm weights as ``1 + w``; the pipeline adds the 1 itself."""
    if not hf_name.endswith("norm.weight"):
        return loaded
    if isinstance(loaded, GGMLTensor):
        loaded = loaded.dequantize(torch.float32)
    return loaded.float() - 1.0


def write_sentencepiece_extras(writer: Any, arch: str, tokens: list[str]) -> None:
    """``pluginfer convert`` beside a SentencePiece vocabulary, as llama.cpp's converter: no space prefix, and for
    Gemma 1 the end-of-turn id of Gemma's vocabulary."""
    if arch == "gemma":
        eot = tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else 107
        if eot < len(tokens):
            writer.add_eot_token_id(eot)
    writer.add_add_space_prefix(False)


def write_hparams(writer: Any, config: dict) -> None:
    """``pluginfer convert``: the keys llama.cpp's converter writes for Gemma beside the common sizes, refusing
    what a GGUF reader would read otherwise (llama.cpp decides the query scale and Gemma 2's soft-caps)."""
    from pluginfer.models.gemma import layer_types, rope_configs
    from pluginfer.models.gguf_config import write_rope

    generation = {"gemma": 1, "gemma2": 2, "gemma3": 3}[writer.arch]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    if generation == 1:
        write_rope(writer, config, head_dim)
        return
    layers = config["num_hidden_layers"]
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == _LAYERS_27B[writer.arch] else head_dim
    if config.get("query_pre_attn_scalar", scalar) != scalar:
        raise ValueError(f"query_pre_attn_scalar {config['query_pre_attn_scalar']} cannot be written to GGUF: "
                         f"llama.cpp reads {scalar} for a {writer.arch} model of {layers} layers")
    kinds = layer_types(config, generation)
    if SLIDING in kinds:
        writer.add_sliding_window(int(config["sliding_window"]))
        writer.add_sliding_window_pattern([kind == SLIDING for kind in kinds])
    if generation == 2:
        caps = {field: config.get(field) for field in ("attn_logit_softcapping", "final_logit_softcapping")}
        if None in caps.values():
            raise ValueError(f"gemma2 {caps}: a GGUF reader applies llama.cpp's soft-caps (50, 30) where none "
                             "is written")
        writer.add_attn_logit_softcapping(float(caps["attn_logit_softcapping"]))
        writer.add_final_logit_softcapping(float(caps["final_logit_softcapping"]))
        write_rope(writer, config, head_dim)
        return
    if config.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    ropes = {kind: rope["rope_parameters"] for kind, rope in rope_configs(config, 3).items()}
    full, local = ropes[FULL], ropes[SLIDING]
    for kind, rope in ropes.items():
        allowed = ("default", "linear") if kind == FULL else ("default",)
        if rope.get("rope_type", "default") not in allowed:
            raise ValueError(f"rope_parameters.{kind}: {rope.get('rope_type')!r} cannot be written to GGUF here "
                             f"(supported: {', '.join(allowed)})")
    writer.add_rope_freq_base(float(full["rope_theta"]))
    writer.add_rope_freq_base_swa(float(local["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    if full.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))


def tensor_for_file(hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``pluginfer convert``: norm weights as llama.cpp stores them (``1 + w``)."""
    return tensor + 1.0 if hf_name.endswith("norm.weight") else tensor
