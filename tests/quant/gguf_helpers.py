"""GGUF test helpers: the transformers oracle (gguf-py dequantization, its own q/k un-permutation)."""

from __future__ import annotations

from pathlib import Path

import torch


def transformers_from_gguf(path: Path, rope_parameters: dict | None = None,
                           config_fields: dict | None = None) -> torch.nn.Module:
    """transformers' reading of a .gguf file: its config mapping, gguf-py's dequantize, its name map.

    Built without ``from_pretrained(gguf_file=...)``, which needs accelerate, from the same pieces.
    ``rope_parameters``: set by hand (transformers' GGUF config mapping ignores llama3's rope_freqs);
    ``config_fields``: others its mapping leaves out (e.g. the MoE families' expert sizes), set by hand too.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if rope_parameters is not None:
        config.rope_parameters = {**rope_parameters, "rope_theta": config.rope_parameters["rope_theta"]}
    for key, value in (config_fields or {}).items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    params = model.state_dict()
    for name, tensor in tensors.items():  # its Qwen2-MoE shared_expert_gate comes as [1, 1, hidden]
        if name in params and tensor.shape != params[name].shape and tensor.squeeze(0).shape == params[name].shape:
            tensors[name] = tensor.squeeze(0)
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(result.missing_keys) <= allowed, result.missing_keys
    if config.tie_word_embeddings:
        model.tie_weights()
    return model
