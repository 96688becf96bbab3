"""A checkpoint's fixed KV cache scales (``engine/kv_scales.py``): vLLM's / KsanaLLM's ``kv_cache_scales.json`` and
compressed-tensors' ``k_scale`` / ``v_scale`` tensors reach every row the cache writes; a file that does not fit
the model is an error naming the layer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pluginfer import LLM, SamplingParams
from pluginfer.layers import kv_quant


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _scale_file(path: Path, layers: dict, dtype: str = "float8_e4m3fn") -> None:
    (path / "kv_cache_scales.json").write_text(json.dumps(
        {"model_type": "llama", "kv_cache": {"dtype": dtype, "scaling_factor": {"0": layers}}}))


def _generate(path: Path, kv_cache_dtype: str) -> LLM:
    llm = LLM(model=str(path), dtype="float32", num_blocks=32, block_size=8, kv_cache_dtype=kv_cache_dtype)
    llm.generate([[11, 12, 13, 14, 15]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    return llm


def _written_scales(llm: LLM, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales of the 8 slots the request wrote (block 0 and the next: the only blocks it used)."""
    key_cache, value_cache = llm.engine.executor.kv_caches[layer]
    return kv_quant.scales(key_cache).reshape(-1, key_cache.shape[2])[:8], \
        kv_quant.scales(value_cache).reshape(-1, key_cache.shape[2])[:8]


def test_the_scale_file_fixes_every_rows_scale(tiny_llama_checkpoint, tmp_path: Path) -> None:
    path = _copy(tiny_llama_checkpoint[0], tmp_path / "model")
    _scale_file(path, {"0": 0.05, "1": 0.125})
    llm = _generate(path, "fp8")
    for layer, scale in ((0, 0.05), (1, 0.125)):
        assert isinstance(llm.engine.executor.kv_caches[layer], kv_quant.FixedScaleKVCache)
        for written in _written_scales(llm, layer):
            assert torch.equal(written, torch.full_like(written, scale))


def test_k_scale_and_v_scale_tensors_per_head(tiny_llama_checkpoint, tmp_path: Path) -> None:
    path = _copy(tiny_llama_checkpoint[0], tmp_path / "model")
    [weights_file] = path.glob("*.safetensors")
    tensors = load_file(weights_file)
    for layer in range(2):  # the tiny llama's 2 layers, 2 KV heads
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([0.02, 0.03]) * (layer + 1)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.01)  # one for every head
    save_file(tensors, weights_file, metadata={"format": "pt"})
    llm = _generate(path, "int8")
    keys, values = _written_scales(llm, 1)
    assert torch.equal(keys, torch.tensor([0.04, 0.06]).expand_as(keys))
    assert torch.equal(values, torch.full_like(values, 0.01))
    # a float cache ignores them (and the weights load without them)
    _generate(path, "float32")


@pytest.mark.parametrize(("layers", "dtype", "kv_cache_dtype", "message"), [
    ({"0": 0.05}, "float8_e4m3fn", "fp8", r"kv_cache_scales.json: no k_scale for layer 1 \(the model has 2 layers\)"),
    ({"0": 0.05, "1": 0.1, "2": 0.1}, "float8_e4m3fn", "fp8", "scales for layer 2, but the model has 2 layers"),
    ({"0": 0.05, "1": -1}, "float8_e4m3fn", "fp8", "layer 1: the scale -1 is no positive number"),
    ({"0": 0.05, "1": 0.1}, "float8_e4m3fn", "int8", "scales are for a float8_e4m3fn KV cache, but "
                                                       "cache.kv_cache_dtype is int8"),
])
def test_a_scale_file_that_does_not_fit_names_the_layer(tiny_llama_checkpoint, tmp_path: Path, layers: dict,
                                                        dtype: str, kv_cache_dtype: str, message: str) -> None:
    path = _copy(tiny_llama_checkpoint[0], tmp_path / "model")
    _scale_file(path, layers, dtype)
    with pytest.raises(ValueError, match=message):
        _generate(path, kv_cache_dtype)


def test_a_scale_tensor_of_the_wrong_size_names_the_layer(tiny_llama_checkpoint, tmp_path: Path) -> None:
    path = _copy(tiny_llama_checkpoint[0], tmp_path / "model")
    [weights_file] = path.glob("*.safetensors")
    tensors = load_file(weights_file)
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([0.02, 0.03, 0.04][:2 + layer])
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.01)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layer 1: 3 k_scale values, but the model has 2 KV heads"):
        _generate(path, "fp8_e5m2")
