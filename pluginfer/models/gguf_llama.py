"""GGUF files of the llama family (llama, mistral; qwen2, qwen3): their metadata as the ``config.json`` the
llama and qwen pipelines accept, their tensor names as Hugging Face's (gguf-py's own name map, inverted),
llama's q/k rows put back in Hugging Face order. The model plugin's ``converters["gguf"]``
(``pluginfer.formats.gguf.checkpoint`` reads the file); ``pluginfer convert`` writes what this reads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pluginfer.formats.gguf.checkpoint import GGMLTensor, GGUFCheckpoint, GGUFModel

# GGUF general.architecture -> the Hugging Face architecture of our pipelines.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# The HF modules of the llama/qwen families; gguf-py maps each to its GGUF name, the checkpoint inverts that.
HF_MODULES = (
    "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj", "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.self_attn.q_norm", "model.layers.{bid}.self_attn.k_norm",
    "model.layers.{bid}.mlp.gate_proj", "model.layers.{bid}.mlp.up_proj", "model.layers.{bid}.mlp.down_proj",
)
# llama.cpp's per-frequency rope divisors (llama3 rope scaling); no HF tensor, the config's rope_scaling.
_ROPE_FREQS = "rope_freqs.weight"


def convert(checkpoint: GGUFCheckpoint) -> GGUFModel:
    """The model in a llama/qwen2/qwen3 GGUF file (the llama and qwen specs' ``converters["gguf"]``); a llama
    file with experts (Mixtral) is ``gguf_moe``'s."""
    if checkpoint.field("{arch}.expert_count"):
        from pluginfer.models.gguf_moe import convert as convert_moe

        return convert_moe(checkpoint)
    config = hf_config(checkpoint)
    fix = None
    if checkpoint.arch == "llama":
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

        def fix(hf_name: str, loaded: Any) -> Any:
            projection = hf_name.split(".")[-2]
            return unpermute_rows(loaded, heads[projection]) if projection in heads else loaded

    return GGUFModel(config, HF_MODULES, ignored_tensors=(_ROPE_FREQS,), fix=fix)


def hf_config(checkpoint: GGUFCheckpoint) -> dict:
    """The config.json a Hugging Face checkpoint of this llama/qwen2/qwen3 model would have."""
    heads = int(checkpoint.require("{arch}.attention.head_count"))
    hidden = int(checkpoint.require("{arch}.embedding_length"))
    head_dim = int(checkpoint.field("{arch}.attention.key_length") or hidden // heads)
    value_dim = int(checkpoint.field("{arch}.attention.value_length") or head_dim)
    rope_dim = int(checkpoint.field("{arch}.rope.dimension_count") or head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(f"{checkpoint.path}: key_length {head_dim}, value_length {value_dim} and "
                         f"rope.dimension_count {rope_dim} differ; the {checkpoint.arch} pipeline needs them equal")
    tokens = checkpoint.array_length("tokenizer.ggml.tokens")  # counted, not decoded (the tokenizer decodes them)
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES.get(checkpoint.arch, checkpoint.arch)],  # others' are their own
        "model_type": checkpoint.arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(checkpoint.require("{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(checkpoint.field("{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(checkpoint.require("{arch}.feed_forward_length")),
        "rms_norm_eps": float(checkpoint.field("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(checkpoint.field("{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(checkpoint.field("{arch}.context_length", 2048)),
        "vocab_size": tokens if tokens is not None else int(checkpoint.require("{arch}.vocab_size")),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in checkpoint.tensors,
        # Linear layers keep the file's block types; docs/quantization.md says why float32 by default.
        "torch_dtype": "float32",
        "quantization_config": {"quant_method": "gguf"},
    }
    has_bias = "blk.0.attn_q.bias" in checkpoint.tensors
    if checkpoint.arch in ("llama", "qwen3"):
        config["attention_bias"] = has_bias
    if checkpoint.arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in checkpoint.tensors
    window = checkpoint.field("{arch}.attention.sliding_window")
    if window:
        if checkpoint.arch != "llama":
            raise ValueError(f"{checkpoint.path}: attention.sliding_window is supported for llama GGUF files only")
        config["sliding_window"] = int(window)
    for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if checkpoint.field(key) is not None:
            config[name] = int(checkpoint.field(key))
    end_of_turn = checkpoint.field("tokenizer.ggml.eot_token_id")  # chat models end a turn with it (<|im_end|>)
    if end_of_turn is not None and int(end_of_turn) != config.get("eos_token_id"):
        config["eos_token_id"] = [i for i in (config.get("eos_token_id"), int(end_of_turn)) if i is not None]
    scaling = _rope_scaling(checkpoint)
    if _ROPE_FREQS in checkpoint.tensors:
        scaling = _with_rope_freqs(checkpoint, scaling, head_dim)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(checkpoint: GGUFCheckpoint) -> dict | None:
    kind = checkpoint.field("{arch}.rope.scaling.type")
    factor = checkpoint.field("{arch}.rope.scaling.factor")
    if kind in (None, "none") and not factor:
        return None
    if kind == "linear" or (kind is None and factor):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = checkpoint.field("{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ValueError(f"{checkpoint.path}: rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def _with_rope_freqs(checkpoint: GGUFCheckpoint, scaling: dict | None, head_dim: int) -> dict:
    """The file's ``rope_freqs`` divisors as ``rope_scaling.frequency_factors``, applied as given (llama.cpp
    divides each rope frequency by its factor, whatever rope scaling computed them: llama3's with any
    factor, frequency factors and original context), on top of the file's linear scaling if it has one."""
    tensor = checkpoint.tensors[_ROPE_FREQS]
    if tensor.tensor_type.name != "F32":
        raise ValueError(f"{checkpoint.path}: tensor {_ROPE_FREQS!r} is {tensor.tensor_type.name}; llama.cpp "
                         "reads it as F32")
    factors = np.array(tensor.data, dtype=np.float32).reshape(-1)
    if factors.size != head_dim // 2 or not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ValueError(f"{checkpoint.path}: tensor {_ROPE_FREQS!r} holds {factors.size} values; expected "
                         f"{head_dim // 2} positive finite rope frequency divisors (head_dim {head_dim} / 2)")
    if scaling is not None and scaling["rope_type"] != "linear":
        raise ValueError(f"{checkpoint.path}: tensor {_ROPE_FREQS!r} with rope scaling type "
                         f"{scaling['rope_type']!r} is not supported (rope_freqs applies with no scaling type or linear)")
    return {**(scaling or {"rope_type": "default"}), "frequency_factors": factors.tolist()}


def unpermute_rows(loaded: torch.Tensor | GGMLTensor, num_heads: int) -> torch.Tensor | GGMLTensor:
    """Undo llama.cpp's ``permute`` of q/k rows (per head: interleaved halves -> HF's rotate-half order).

    It moves whole rows, so it applies to a quantized tensor's rows of blocks as well.
    """
    rows = loaded.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"q/k tensor of {rows} rows is not {num_heads} heads of an even size")
    permuted = torch.arange(rows).reshape(num_heads, 2, rows // num_heads // 2).transpose(1, 2).reshape(-1)
    inverse = torch.argsort(permuted)
    if isinstance(loaded, GGMLTensor):
        return GGMLTensor(loaded.raw[inverse], loaded.qtype, loaded.shape, loaded.name)
    return loaded[inverse]


def permute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's ``permute`` (convert_hf_to_gguf.py): HF q/k rows -> the order GGUF llama files use."""
    rows = weight.shape[0]
    permuted = torch.arange(rows).reshape(num_heads, 2, rows // num_heads // 2).transpose(1, 2).reshape(-1)
    return weight[permuted]


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> torch.Tensor:
    """The ``rope_freqs`` divisors llama.cpp's converter writes for llama3 rope scaling (its float32 steps)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)
