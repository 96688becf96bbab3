"""The ``config.json`` fields every decoder's GGUF file holds the same way (sizes, norm epsilon, rope base,
special tokens, tied head), read once for the gemma, phi, stablelm and glm4 GGUF mappings."""

from __future__ import annotations

from typing import Any

from pluginfer.formats.gguf.checkpoint import GGUFCheckpoint


def decoder_config(checkpoint: GGUFCheckpoint, architecture: str, model_type: str) -> dict[str, Any]:
    """Sizes, rope base, context, vocabulary, tied head and special tokens; linears kept in the file's blocks."""
    heads = int(checkpoint.require("{arch}.attention.head_count"))
    hidden = int(checkpoint.require("{arch}.embedding_length"))
    head_dim = int(checkpoint.field("{arch}.attention.key_length") or hidden // heads)
    value_dim = int(checkpoint.field("{arch}.attention.value_length") or head_dim)
    if value_dim != head_dim:
        raise ValueError(f"{checkpoint.path}: attention.key_length {head_dim} and value_length {value_dim} differ; "
                         f"the {checkpoint.arch} pipeline needs them equal")
    tokens = checkpoint.array_length("tokenizer.ggml.tokens")  # counted, not decoded (the tokenizer decodes them)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(checkpoint.require("{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(checkpoint.field("{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(checkpoint.require("{arch}.feed_forward_length")),
        "rope_theta": float(checkpoint.field("{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(checkpoint.field("{arch}.context_length", 2048)),
        "vocab_size": tokens if tokens is not None else int(checkpoint.require("{arch}.vocab_size")),
        "tie_word_embeddings": "output.weight" not in checkpoint.tensors,
        # Linear layers keep the file's block types; docs/quantization.md says why float32 by default.
        "torch_dtype": "float32",
        "quantization_config": {"quant_method": "gguf"},
    }
    for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if checkpoint.field(key) is not None:
            config[name] = int(checkpoint.field(key))
    end_of_turn = checkpoint.field("tokenizer.ggml.eot_token_id")  # chat models end a turn with it
    if end_of_turn is not None and int(end_of_turn) != config.get("eos_token_id"):
        config["eos_token_id"] = [i for i in (config.get("eos_token_id"), int(end_of_turn)) if i is not None]
    return config


def rotary_factor(checkpoint: GGUFCheckpoint, head_dim: int) -> float:
    """The share of each head that rope turns (``rope.dimension_count`` over the head size; 1 when absent)."""
    rotary = int(checkpoint.field("{arch}.rope.dimension_count") or head_dim)
    if rotary > head_dim or rotary % 2:
        raise ValueError(f"{checkpoint.path}: rope.dimension_count {rotary} must be even and at most the head "
                         f"size {head_dim}")
    return rotary / head_dim


def rows_of(checkpoint: GGUFCheckpoint, tensor_name: str) -> int:
    """The output rows of a 2-D tensor (GGML lists the fastest axis first)."""
    if tensor_name not in checkpoint.tensors:
        raise ValueError(f"{checkpoint.path}: GGUF tensor {tensor_name!r} is missing")
    return int(checkpoint.tensors[tensor_name].shape[-1])


def linear_scaling(checkpoint: GGUFCheckpoint) -> dict | None:
    """The file's rope scaling when it is none or linear (what these families' files hold); others are errors."""
    kind = checkpoint.field("{arch}.rope.scaling.type")
    factor = checkpoint.field("{arch}.rope.scaling.factor")
    if kind in (None, "none") and not factor:
        return None
    if kind in (None, "linear") and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    raise ValueError(f"{checkpoint.path}: rope scaling type {kind!r} is not supported for {checkpoint.arch} GGUF "
                     "files (supported: linear)")


def write_rope(writer: Any, config: dict, rotary_dim: int) -> None:
    """``pluginfer convert``: the rope base and rotated size of a family with no rope scaling in GGUF here."""
    from pluginfer.layers.rotary import rope_parameters

    theta, scaling = rope_parameters(config)
    if scaling["rope_type"] != "default":
        raise ValueError(f"rope scaling {scaling['rope_type']!r} cannot be written to a {writer.arch} GGUF file here "
                         "(supported: none)")
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(rotary_dim)
