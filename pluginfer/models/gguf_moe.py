"""GGUF files of the mixture-of-experts families: llama files with merged experts (how llama.cpp writes
Mixtral), ``qwen2moe`` and ``qwen3moe``; their metadata as the ``config.json`` of the mixtral, qwen2-moe and
qwen3-moe pipelines, their tensors under Hugging Face's names.

llama.cpp merges a layer's experts into one 3-D tensor per projection (``ffn_{gate,up,down}_exps``,
``[experts, rows, cols]``); ``expand_experts`` hands the pipeline each expert's rows of blocks under its HF
name, which ``layers.moe`` keeps as layers of the ``gguf`` quant method (its ``holds_experts``), as every other
linear layer keeps the file's GGML blocks. Routing follows llama.cpp's graph for each architecture:
Mixtral and Qwen3-MoE renormalize the top-k weights, Qwen2-MoE does not.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from pluginfer.formats.gguf.checkpoint import GGMLTensor, GGUFCheckpoint, GGUFModel
from pluginfer.models import gguf_llama

# GGUF general.architecture -> (HF architecture, model_type) of the pipeline that runs it.
MOE_ARCHITECTURES = {"llama": ("MixtralForCausalLM", "mixtral"), "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
                     "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe")}
# Whether llama.cpp's graph renormalizes the top-k router weights (a constant per architecture, not metadata).
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}

_ATTENTION = ("model.embed_tokens", "model.norm", "lm_head",
              "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_attention_layernorm",
              "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.k_proj",
              "model.layers.{bid}.self_attn.v_proj", "model.layers.{bid}.self_attn.o_proj")
_MIXTRAL = ("model.layers.{bid}.block_sparse_moe.gate", "model.layers.{bid}.block_sparse_moe.experts.w1",
            "model.layers.{bid}.block_sparse_moe.experts.w2", "model.layers.{bid}.block_sparse_moe.experts.w3")
_QWEN_MOE = ("model.layers.{bid}.mlp.gate", "model.layers.{bid}.mlp.experts.gate_proj",
             "model.layers.{bid}.mlp.experts.up_proj", "model.layers.{bid}.mlp.experts.down_proj",
             # the dense MLP of a layer in mlp_only_layers
             "model.layers.{bid}.mlp.gate_proj", "model.layers.{bid}.mlp.up_proj", "model.layers.{bid}.mlp.down_proj")
HF_MODULES = {
    "llama": _ATTENTION + _MIXTRAL,
    "qwen2moe": _ATTENTION + _QWEN_MOE + ("model.layers.{bid}.mlp.shared_expert.gate_proj",
                                          "model.layers.{bid}.mlp.shared_expert.up_proj",
                                          "model.layers.{bid}.mlp.shared_expert.down_proj",
                                          "model.layers.{bid}.mlp.shared_expert_gate"),
    "qwen3moe": _ATTENTION + _QWEN_MOE + ("model.layers.{bid}.self_attn.q_norm", "model.layers.{bid}.self_attn.k_norm"),
}
# An HF name gguf-py gives a merged expert tensor: "<layer>.experts.<projection>.weight".
_MERGED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<projection>[a-z0-9_]+)\.weight$")


def convert(checkpoint: GGUFCheckpoint) -> GGUFModel:
    """The model in a GGUF file with merged experts (the mixtral, qwen2-moe and qwen3-moe specs'
    ``converters["gguf"]``; llama files reach it through ``gguf_llama.convert``)."""
    config = hf_config(checkpoint)
    fix = None
    if checkpoint.arch == "llama":
        # llama's q/k rows are stored permuted, as in dense llama files
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

        def fix(hf_name: str, loaded: Any) -> Any:
            projection = hf_name.split(".")[-2]
            return gguf_llama.unpermute_rows(loaded, heads[projection]) if projection in heads else loaded

    return GGUFModel(config, HF_MODULES[checkpoint.arch], expand=expand_experts, fix=fix)


def hf_config(checkpoint: GGUFCheckpoint) -> dict:
    """The config.json of the Mixtral, Qwen2-MoE or Qwen3-MoE checkpoint this file was converted from."""
    arch = checkpoint.arch
    config = gguf_llama.hf_config(checkpoint)
    attention_bias, mlp_bias = config.pop("attention_bias", False), config.pop("mlp_bias", False)
    if arch == "llama" and (attention_bias or mlp_bias):
        raise ValueError(f"{checkpoint.path}: a llama file with experts (Mixtral) and attention or MLP biases is "
                         "not supported")
    architecture, model_type = MOE_ARCHITECTURES[arch]
    experts = int(checkpoint.require("{arch}.expert_count"))
    expert_size = int(checkpoint.field("{arch}.expert_feed_forward_length") or config["intermediate_size"])
    config.update(architectures=[architecture], model_type=model_type,
                  num_experts_per_tok=int(checkpoint.require("{arch}.expert_used_count")))
    if arch == "llama":  # Mixtral always renormalizes
        config.update(num_local_experts=experts, intermediate_size=expert_size)
        return config
    config["norm_topk_prob"] = _NORM_TOPK[arch]
    dense = [layer for layer in range(config["num_hidden_layers"])
             if f"blk.{layer}.ffn_gate_exps.weight" not in checkpoint.tensors]
    config.update(num_experts=experts, moe_intermediate_size=expert_size, decoder_sparse_step=1,
                  mlp_only_layers=dense)
    if arch == "qwen3moe":
        config["attention_bias"] = "blk.0.attn_q.bias" in checkpoint.tensors
    else:
        config["qkv_bias"] = "blk.0.attn_q.bias" in checkpoint.tensors
        shared = checkpoint.field("{arch}.expert_shared_feed_forward_length")
        if not shared:
            # files from before the key: the shared expert's own rows (GGML lists hidden first)
            first = next((f"blk.{layer}.ffn_gate_shexp.weight" for layer in range(config["num_hidden_layers"])
                          if f"blk.{layer}.ffn_gate_shexp.weight" in checkpoint.tensors), None)
            if first is None:
                raise ValueError(f"{checkpoint.path}: a qwen2moe file without a shared expert is not supported")
            shared = checkpoint.tensors[first].shape[1]
        config["shared_expert_intermediate_size"] = int(shared)
    return config


def expand_experts(hf_name: str, loaded: Any) -> Iterator[tuple[str, Any]]:
    """A merged ``[experts, rows, cols]`` tensor as each expert's ``<layer>.experts.<e>.<projection>.weight``:
    its rows of blocks (a view of the file), or its float rows; any other tensor as it is."""
    match = _MERGED_EXPERTS.match(hf_name)
    if match is None or len(loaded.shape) != 3:
        yield hf_name, loaded
        return
    for expert in range(loaded.shape[0]):
        if isinstance(loaded, GGMLTensor):
            weight = GGMLTensor(loaded.raw[expert], loaded.qtype, loaded.shape[1:], loaded.name)
        else:
            weight = loaded[expert]
        yield f"{match['prefix']}.{expert}.{match['projection']}.weight", weight


# HF architecture -> GGUF general.architecture ``pluginfer convert`` writes (Mixtral as llama.cpp does: a llama file).
WRITTEN_ARCHITECTURES = {"MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
                         "Qwen3MoeForCausalLM": "qwen3moe"}
# Architectures whose llama.cpp loader requires output.weight: a tied head is written as a copy of the embedding.
HEAD_REQUIRED = ("qwen2moe",)
# An HF name of one expert's projection: "<layer>.experts.<e>.<projection>.weight".
_ONE_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<projection>[a-z0-9_]+)\.weight$")
# Routers llama.cpp's converter keeps in F32 (its graph reads them as float rows).
ROUTERS = (".block_sparse_moe.gate.weight", ".mlp.gate.weight", ".mlp.shared_expert_gate.weight")


def write_hparams(writer: Any, config: dict) -> None:
    """The expert keys llama.cpp's converter writes beside the llama/qwen ones."""
    experts = config.get("num_local_experts") or config["num_experts"]
    writer.add_expert_count(int(experts))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if writer.arch == "llama":  # Mixtral's experts are intermediate_size wide (feed_forward_length)
        return
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise ValueError("mlp_only_layers / decoder_sparse_step: dense layers between expert layers cannot be "
                         "written to GGUF here")
    writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if writer.arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))
    elif not config.get("norm_topk_prob", False):  # llama.cpp's qwen3moe graph always renormalizes
        raise ValueError("norm_topk_prob: a Qwen3-MoE model that does not renormalize its top-k weights cannot be "
                         "written to GGUF (llama.cpp's qwen3moe graph renormalizes them)")


def merged_name(hf_name: str) -> str:
    """The name ``merge_experts`` gives the tensor holding ``hf_name``."""
    match = _ONE_EXPERT.match(hf_name)
    return hf_name if match is None else f"{match['prefix']}.{match['projection']}.weight"


def merge_experts(weights: Iterator[tuple[str, Any]], experts: int) -> Iterator[tuple[str, Any]]:
    """Each layer's per-expert projections as one ``[experts, rows, cols]`` tensor under
    ``<layer>.experts.<projection>.weight`` (llama.cpp's ``ffn_*_exps``), once all its experts have come;
    any other tensor as it is."""
    import torch

    pending: dict[str, dict[int, Any]] = {}
    for hf_name, tensor in weights:
        match = _ONE_EXPERT.match(hf_name)
        if match is None:
            yield hf_name, tensor
            continue
        if isinstance(tensor, GGMLTensor):
            raise ValueError(f"{hf_name}: experts already in GGML blocks cannot be merged here")
        merged = merged_name(hf_name)
        group = pending.setdefault(merged, {})
        group[int(match["expert"])] = tensor
        if len(group) == experts:
            yield merged, torch.stack([group[e] for e in range(experts)])
            del pending[merged]
    if pending:
        raise ValueError(f"{next(iter(pending))}: the checkpoint has {len(next(iter(pending.values())))} of its "
                         f"{experts} experts")
