"""Tiny W8A8 (int8, float8) checkpoints written by compressed-tensors itself (the library llm-compressor saves
with)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_w8a8_checkpoint(model: torch.nn.Module, out_dir: Path, tokenizer_dir: Path, scheme: str = "W8A8") -> Path:
    """``model`` (a transformers causal LM, changed in place) quantized with compressed-tensors' ``scheme`` preset
    (``W8A8``, ``FP8_DYNAMIC``) on every Linear but the LM head, as llm-compressor's recipes do: per-channel scales
    from each weight's min/max (its calculate_qparams), weights compressed by ModelCompressor in the scheme's
    format, saved with its quantization_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from tests.checkpoints import copy_tokenizer

    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            weight = module.weight.data
            scale, zero = calculate_qparams(weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True),
                                            module.quantization_scheme.weights)
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero)
    fmt = "float-quantized" if scheme.startswith("FP8") else "int-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir
