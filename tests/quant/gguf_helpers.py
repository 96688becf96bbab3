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


def transformers_from_source(path: Path, architecture: str, config: dict) -> torch.nn.Module:
    """transformers' ``architecture`` built from the source checkpoint's ``config`` with the file's weights.

    For the families whose GGUF config transformers maps short of llama.cpp's meaning (Gemma 2/3's
    ``query_pre_attn_scalar`` and Gemma 3's final soft-capping are left at transformers' defaults) or not at
    all (gemma, phi2, glm4): the config is the one llama.cpp's converter read. The weights are transformers'
    GGUF reading where it has one (``load_gguf_checkpoint``), else gguf-py's: its name map and dequantization,
    with the one change llama.cpp's converter makes to these files undone (Gemma's norm weights stored + 1).
    """
    import gguf
    import transformers
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model_cls = getattr(transformers, architecture)
    model = model_cls(model_cls.config_class(**config)).to(torch.float32).eval()
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch in GGUF_CONFIG_MAPPING:
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        # transformers' reader leaves out StableLM's stacked per-head q/k norms: gguf-py's rows give them
        tensors.update({name: tensor for name, tensor in _gguf_py_tensors(reader, arch, model, strict=False).items()
                        if name not in tensors})
    else:
        tensors = _gguf_py_tensors(reader, arch, model)
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    tied = model.config.tie_word_embeddings
    assert set(result.missing_keys) <= ({"lm_head.weight"} if tied else set()), result.missing_keys
    if tied:
        model.tie_weights()
    return model


def _gguf_py_tensors(reader: object, arch: str, model: torch.nn.Module, strict: bool = True) -> dict[str, torch.Tensor]:
    import re

    import gguf
    import numpy as np

    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name_map = gguf.get_tensor_name_map(model_arch, model.config.num_hidden_layers)
    in_file = {tensor.name: tensor for tensor in reader.tensors}
    tensors, used = {}, set()
    for hf_name in model.state_dict():
        module, _, suffix = hf_name.rpartition(".")
        per_head = re.fullmatch(r"(.*_layernorm)\.norms\.(\d+)", module)  # StableLM's one LayerNorm per head
        if per_head:
            module = per_head[1]
        gguf_name = f"{name_map.get_name(module)}.{suffix}"
        if gguf_name not in in_file:
            continue
        tensor = in_file[gguf_name]
        used.add(gguf_name)
        dense = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        dense = torch.from_numpy(np.array(dense, dtype=np.float32)).reshape(  # a copy: the mapping is read-only
            [int(d) for d in reversed(tensor.shape)])
        if per_head:
            dense = dense[int(per_head[2])]  # llama.cpp's StableLMModel._stack_qk_norm stacks the heads in order
        if arch == "gemma" and hf_name.endswith("norm.weight"):
            dense = dense - 1  # llama.cpp's GemmaModel.modify_tensors writes norm weights + 1
        tensors[hf_name] = dense
    unused = sorted(set(in_file) - used)
    assert not (strict and unused), f"tensors transformers' {type(model).__name__} has no place for: {unused}"
    return tensors
