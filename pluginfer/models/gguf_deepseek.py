"""GGUF files of DeepSeek-V2/V3 (llama.cpp's ``deepseek2``): their metadata as the deepseek pipeline's
``config.json``, their tensors under Hugging Face's names.

``kv_b_proj`` is read whole (older files) or joined back from ``attn_k_b`` / ``attn_v_b`` per head, since
``layers.mla`` holds it dense; merged experts are split per expert (``gguf_moe.expand_experts``) and keep the
file's GGML blocks. The router is V3's (sigmoid, ``noaux_tc``) where ``expert_gating_func`` says sigmoid, else V2's.

``write_hparams`` and ``weights_for_file`` write such a file (``pluginfer convert``) as llama.cpp's converter does:
``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``, experts merged, V3's router bias as
``exp_probs_b``, the cache's one KV head and the latent's key/value lengths beside the per-head ``*_mla`` ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pluginfer.formats.gguf.checkpoint import GGMLTensor, GGUFCheckpoint, GGUFModel
from pluginfer.models.gguf_moe import expand_experts, merge_experts

HF_MODULES = (
    "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.q_a_proj",
    "model.layers.{bid}.self_attn.q_a_layernorm", "model.layers.{bid}.self_attn.q_b_proj",
    "model.layers.{bid}.self_attn.kv_a_proj_with_mqa", "model.layers.{bid}.self_attn.kv_a_layernorm",
    "model.layers.{bid}.self_attn.kv_b_proj", "model.layers.{bid}.self_attn.k_b_proj",
    "model.layers.{bid}.self_attn.v_b_proj", "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.mlp.gate_proj", "model.layers.{bid}.mlp.up_proj", "model.layers.{bid}.mlp.down_proj",
    "model.layers.{bid}.mlp.gate", "model.layers.{bid}.mlp.gate.e_score_correction",
    "model.layers.{bid}.mlp.experts.gate_proj", "model.layers.{bid}.mlp.experts.up_proj",
    "model.layers.{bid}.mlp.experts.down_proj",
    "model.layers.{bid}.mlp.shared_experts.gate_proj", "model.layers.{bid}.mlp.shared_experts.up_proj",
    "model.layers.{bid}.mlp.shared_experts.down_proj",
)
# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax, the default)
_SIGMOID = 2


def convert(checkpoint: GGUFCheckpoint) -> GGUFModel:
    """The model in a ``deepseek2`` GGUF file (the deepseek spec's ``converters["gguf"]``)."""
    config = hf_config(checkpoint)
    heads, nope, v_dim = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    dense = tuple(f"model.layers.{layer}.self_attn.kv_b_proj.weight" for layer in range(config["num_hidden_layers"]))
    return GGUFModel(config, HF_MODULES, dense_tensors=dense, expand=_KvBJoiner(heads, nope, v_dim).expand)


def hf_config(checkpoint: GGUFCheckpoint) -> dict:
    """The config.json of the DeepSeek-V2 or V3 checkpoint this file was converted from."""
    heads = int(checkpoint.require("{arch}.attention.head_count"))
    rope_dim = int(checkpoint.require("{arch}.rope.dimension_count"))
    # Files with the split kv_b give the per-head sizes as *_mla; older ones as the plain lengths.
    key_length = int(checkpoint.field("{arch}.attention.key_length_mla") or checkpoint.require("{arch}.attention.key_length"))
    value_length = int(checkpoint.field("{arch}.attention.value_length_mla")
                       or checkpoint.require("{arch}.attention.value_length"))
    v3 = int(checkpoint.field("{arch}.expert_gating_func", 1)) == _SIGMOID
    experts = checkpoint.field("{arch}.expert_count")
    groups, used_groups = (int(checkpoint.field(key) or 1) for key in ("{arch}.expert_group_count",
                                                                       "{arch}.expert_group_used_count"))
    q_lora = checkpoint.field("{arch}.attention.q_lora_rank")
    tokens = checkpoint.array_length("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "hidden_size": int(checkpoint.require("{arch}.embedding_length")),
        "num_hidden_layers": int(checkpoint.require("{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # the file's head_count_kv 1 is the latent cache's one head
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(checkpoint.require("{arch}.attention.kv_lora_rank")),
        "qk_nope_head_dim": key_length - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": value_length,
        "intermediate_size": int(checkpoint.require("{arch}.feed_forward_length")),
        "moe_intermediate_size": int(checkpoint.field("{arch}.expert_feed_forward_length") or 0) or None,
        "n_routed_experts": int(experts) if experts else None,
        "n_shared_experts": int(checkpoint.field("{arch}.expert_shared_count") or 0),
        "num_experts_per_tok": int(checkpoint.field("{arch}.expert_used_count") or 1),
        "first_k_dense_replace": int(checkpoint.field("{arch}.leading_dense_block_count") or 0),
        "moe_layer_freq": 1,
        "norm_topk_prob": bool(checkpoint.field("{arch}.expert_weights_norm", False)),
        "routed_scaling_factor": float(checkpoint.field("{arch}.expert_weights_scale") or 1.0),
        "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
        "n_group": groups,
        "topk_group": used_groups,
        "rms_norm_eps": float(checkpoint.field("{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(checkpoint.field("{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(checkpoint.field("{arch}.context_length", 2048)),
        "vocab_size": tokens if tokens is not None else int(checkpoint.require("{arch}.vocab_size")),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in checkpoint.tensors,
        "torch_dtype": "float32",  # as gguf_llama: linear layers keep the file's block types
        "quantization_config": {"quant_method": "gguf"},
    }
    if v3:
        config["rope_interleave"] = True  # llama.cpp rotates DeepSeek's adjacent pairs
    scaling = _rope_scaling(checkpoint)
    if scaling:
        config["rope_scaling"] = scaling
    for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if checkpoint.field(key) is not None:
            config[name] = int(checkpoint.field(key))
    return config


def _rope_scaling(checkpoint: GGUFCheckpoint) -> dict | None:
    """YaRN as DeepSeek's configs give it; llama.cpp keeps ``0.1 * mscale_all_dim`` as the log multiplier."""
    kind = checkpoint.field("{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ValueError(f"{checkpoint.path}: rope scaling type {kind!r} is not supported for deepseek2 (supported: yarn)")
    mscale = float(checkpoint.field("{arch}.rope.scaling.yarn_log_multiplier") or 0.0) / 0.1
    return {"rope_type": "yarn", "factor": float(checkpoint.require("{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(checkpoint.require("{arch}.rope.scaling.original_context_length")),
            "mscale": mscale, "mscale_all_dim": mscale, "beta_fast": 32, "beta_slow": 1}


class _KvBJoiner:
    """``expand`` for deepseek2 files: joins each layer's ``k_b_proj`` and ``v_b_proj`` into ``kv_b_proj``
    (whichever comes first waits, dequantized, for the other), names V3's router bias as HF does, and
    splits merged experts."""

    def __init__(self, heads: int, nope_dim: int, v_dim: int) -> None:
        self.heads, self.nope_dim, self.v_dim = heads, nope_dim, v_dim
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}

    def expand(self, hf_name: str, loaded: Any) -> Iterator[tuple[str, Any]]:
        if hf_name.endswith(".e_score_correction.bias"):
            yield hf_name.replace(".e_score_correction.bias", ".e_score_correction_bias"), loaded
            return
        prefix, _, part = hf_name.removesuffix(".weight").rpartition(".")
        if part not in ("k_b_proj", "v_b_proj") or not hf_name.endswith(".weight"):
            yield from expand_experts(hf_name, loaded)
            return
        dense = loaded.dequantize(torch.float32) if isinstance(loaded, GGMLTensor) else loaded.float()
        rank = dense.shape[1 if part == "k_b_proj" else 2] if dense.dim() == 3 else -1
        expected = (self.heads, rank, self.nope_dim) if part == "k_b_proj" else (self.heads, self.v_dim, rank)
        if tuple(dense.shape) != expected:
            raise ValueError(f"GGUF tensor {getattr(loaded, 'name', hf_name)!r} has the shape {tuple(dense.shape)}; "
                             f"expected {expected} (heads, then the per-head block)")
        parts = self.waiting.setdefault(prefix, {})
        parts[part] = dense
        if len(parts) < 2:
            return
        del self.waiting[prefix]
        key, value = parts["k_b_proj"].transpose(1, 2), parts["v_b_proj"]  # [heads, nope, rank], [heads, v, rank]
        if key.shape[2] != value.shape[2]:
            raise ValueError(f"{prefix}: attn_k_b's kv_lora_rank {key.shape[2]} differs from attn_v_b's {value.shape[2]}")
        yield f"{prefix}.kv_b_proj.weight", torch.cat((key, value), dim=1).reshape(-1, key.shape[2]).contiguous()


def write_hparams(writer: Any, config: dict) -> None:
    """``pluginfer convert``: the keys of llama.cpp's converter for DeepSeek-V2/V3 beside the common sizes (whose
    attention lengths are the latent cache's here: one KV head of ``kv_lora_rank + qk_rope_head_dim``)."""
    import gguf

    from pluginfer.layers.rotary import rope_parameters

    rank, rope, nope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"]), int(config["qk_nope_head_dim"])
    experts = config.get("n_routed_experts")
    if int(config.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"moe_layer_freq {config['moe_layer_freq']}: only every layer past first_k_dense_replace "
                         "holding experts can be written to GGUF (llama.cpp's deepseek2 layout)")
    writer.add_head_count_kv(1)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(int(config["v_head_dim"]))
    writer.add_kv_lora_rank(rank)
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(int(config["q_lora_rank"]))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    theta, scaling = rope_parameters(config)
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(rope)
    if scaling["rope_type"] == "yarn":
        mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale is not None and all_dim is not None and float(mscale) != float(all_dim):
            raise ValueError(f"rope_scaling: mscale {mscale} differs from mscale_all_dim {all_dim}; a deepseek2 "
                             "GGUF file carries one (yarn_log_multiplier)")
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        if all_dim is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(all_dim))
    elif scaling["rope_type"] != "default":
        raise ValueError(f"rope scaling {scaling['rope_type']!r} cannot be written to a deepseek2 GGUF file "
                         "(supported: yarn)")
    dense = config.get("first_k_dense_replace")
    writer.add_leading_dense_block_count(int(dense) if dense is not None else
                                         (0 if experts else int(config["num_hidden_layers"])))
    writer.add_expert_feed_forward_length(int(config.get("moe_intermediate_size") or config["intermediate_size"]))
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    writer.add_expert_shared_count(int(config.get("n_shared_experts") or 0))
    if config.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(float(config["routed_scaling_factor"]))
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if config.get("n_group") is not None:
        writer.add_expert_group_count(int(config["n_group"]))
    if config.get("topk_group") is not None:
        writer.add_expert_group_used_count(int(config["topk_group"]))
    # as llama.cpp's converter, from scoring_func (its absence: softmax); V3's noaux_tc router is sigmoid's anyway
    scoring = config.get("scoring_func") or ("sigmoid" if config.get("topk_method") == "noaux_tc" else None)
    if scoring not in (None, "softmax", "sigmoid"):
        raise ValueError(f"scoring_func {scoring!r} cannot be written to a deepseek2 GGUF file (softmax, sigmoid)")
    if scoring is not None:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType[scoring.upper()])


def weights_for_file(weights: Iterable[tuple[str, Any]], config: dict) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (HF name, tensor) pairs under the names llama.cpp's tensor map gives deepseek2 tensors:
    experts merged, ``kv_b_proj`` split into ``k_b_proj`` ``[heads, kv_lora_rank, nope]`` and ``v_b_proj``
    ``[heads, v_head_dim, kv_lora_rank]``, the router bias as ``e_score_correction.bias``."""
    heads, nope, v_dim = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    if config.get("n_routed_experts"):
        weights = merge_experts(weights, int(config["n_routed_experts"]))
    for hf_name, tensor in weights:
        if hf_name.endswith(".e_score_correction_bias"):
            yield hf_name.replace(".e_score_correction_bias", ".e_score_correction.bias"), tensor
        elif hf_name.endswith(".kv_b_proj.weight"):
            dense = tensor.dequantize(torch.float32) if isinstance(tensor, GGMLTensor) else tensor.float()
            key, value = dense.view(heads, nope + v_dim, dense.shape[-1]).split([nope, v_dim], dim=1)
            yield hf_name.replace("kv_b_proj", "k_b_proj"), key.transpose(1, 2).contiguous()
            yield hf_name.replace("kv_b_proj", "v_b_proj"), value.contiguous()
        else:
            yield hf_name, tensor
