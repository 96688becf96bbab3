"""Finding and loading checkpoints: paths, hub ids, shards, dtypes, and broken weights, through LLM()."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pluginfer import LLM, SamplingParams
from pluginfer.engine.loader import resolve_dtype
from tests.checkpoints import save_hf_model
from tests.conftest import TINY_LLAMA

PROMPTS = ["hello world", "the cat sat on the mat", "once upon a time there was", "a"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)


def _load(path: Path, dtype: str = "float32") -> LLM:
    return LLM(model=str(path), dtype=dtype, num_blocks=32, block_size=8)


def _rewrite_weights(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the single-file checkpoint ``src`` whose tensors ``edit`` changed in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def reference(tiny_llama_checkpoint) -> list:
    """Greedy outputs of the float32 single-file checkpoint (with the top-20 logprobs of each token)."""
    return _load(tiny_llama_checkpoint[0]).generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """The tiny llama again (same seed, same weights), saved in ~50 KB shards with an index file."""
    out = tmp_path_factory.mktemp("sharded")
    save_hf_model("LlamaForCausalLM", TINY_LLAMA, out, tiny_tokenizer_dir, max_shard_size="50KB")
    return out


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="does not exist") as excinfo:
        LLM(model=str(missing))
    assert str(missing) in str(excinfo.value)


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json") as excinfo:
        LLM(model=str(tmp_path))
    assert str(tmp_path) in str(excinfo.value)


def test_directory_without_safetensors(tiny_llama_checkpoint, tmp_path):
    path = tmp_path / "no-weights"
    shutil.copytree(tiny_llama_checkpoint[0], path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors") as excinfo:
        _load(path)
    assert str(path) in str(excinfo.value)


def test_hub_id_while_offline_asks_for_a_local_directory(monkeypatch, tmp_path):
    import huggingface_hub.constants

    # huggingface_hub reads HF_HUB_OFFLINE when it is imported, which has happened by now.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="could not be downloaded") as excinfo:
        LLM(model="pluginfer-tests/no-such-model")
    message = str(excinfo.value)
    assert "pluginfer-tests/no-such-model" in message and "local" in message


def test_sharded_checkpoint_loads_like_the_single_file(sharded_checkpoint, reference):
    index = json.loads((sharded_checkpoint / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (sharded_checkpoint / "model.safetensors").exists()
    outs = _load(sharded_checkpoint).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


def test_a_shard_missing_from_the_index_is_named(sharded_checkpoint, tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(sharded_checkpoint, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    gone = index["weight_map"]["model.norm.weight"]
    (path / gone).unlink()
    with pytest.raises(FileNotFoundError, match=gone):
        _load(path)


# Low precision against float32 on the first generated token. fp16 keeps 11 significant bits
# (relative rounding 2**-11), bf16 8 (2**-8); through two layers the log-probabilities moved by at
# most 0.008 (fp16) and 0.07 (bf16) on these prompts, so each tolerance is about 4x that.
TOLERANCE = {"float16": 0.03, "bfloat16": 0.25}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_dtypes_load_and_track_float32(tiny_llama_checkpoint, reference, dtype):
    llm = _load(tiny_llama_checkpoint[0], dtype)
    assert llm.engine.executor.dtype == getattr(torch, dtype)
    tolerance = TOLERANCE[dtype]
    for ref, out in zip(reference, llm.generate(PROMPTS, GREEDY), strict=True):
        choice = out.outputs[0]
        assert len(choice.token_ids) == 8 and choice.finish_reason == "length"
        expected, got = ref.outputs[0].logprobs[0], choice.logprobs[0]
        shared = set(expected) & set(got)
        assert len(shared) >= 15  # the two top-20 lists mostly agree
        worst = max(abs(expected[t] - got[t]) for t in shared)
        assert worst < tolerance, (dtype, worst)
        # The first token may differ only where float32 itself nearly ties.
        first = choice.token_ids[0]
        assert first in expected and expected[first] >= max(expected.values()) - tolerance


def test_auto_dtype_takes_the_checkpoints(tiny_llama_checkpoint, tiny_tokenizer_dir, tmp_path):
    assert _load(tiny_llama_checkpoint[0], "auto").engine.executor.dtype == torch.float32
    path = tmp_path / "bf16"
    model = save_hf_model("LlamaForCausalLM", TINY_LLAMA, path, tiny_tokenizer_dir, dtype=torch.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    llm = _load(path, "auto")
    assert llm.engine.executor.dtype == torch.bfloat16
    loaded = dict(llm.engine.executor.pipeline.named_parameters())["model.norm.weight"]
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, model.model.norm.weight)
    [out] = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(("hf_config", "expected"), [
    ({"torch_dtype": "float16"}, torch.float16),  # transformers 4 writes torch_dtype
    ({"dtype": "bfloat16"}, torch.bfloat16),  # transformers 5 writes dtype
    ({}, torch.float32),
])
def test_auto_dtype_reads_either_config_key(hf_config, expected):
    assert resolve_dtype("auto", hf_config) == expected


# One tensor of each routing: fused into qkv_proj, plain linear, norm, embedding.
TENSORS = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight",
           "model.norm.weight", "model.embed_tokens.weight"]


@pytest.mark.parametrize("name", TENSORS)
def test_a_tensor_with_the_wrong_shape_is_named(tiny_llama_checkpoint, tmp_path, name):
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][..., :-1].contiguous()

    path = _rewrite_weights(tiny_llama_checkpoint[0], tmp_path / "wrong-shape", shrink)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as excinfo:
        _load(path)
    assert "shape" in str(excinfo.value)


@pytest.mark.parametrize("name", [
    "model.layers.1.mlp.down_proj.weight", "model.norm.weight", "model.embed_tokens.weight",
    "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
])
def test_a_missing_tensor_is_named(tiny_llama_checkpoint, tmp_path, name):
    path = _rewrite_weights(tiny_llama_checkpoint[0], tmp_path / "missing", lambda tensors: tensors.pop(name))
    with pytest.raises(KeyError) as excinfo:
        _load(path)
    assert name in str(excinfo.value) and "missing" in str(excinfo.value)


def test_an_unexpected_tensor_is_named(tiny_llama_checkpoint, tmp_path):
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(4)

    path = _rewrite_weights(tiny_llama_checkpoint[0], tmp_path / "extra", add)
    with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.extra\.weight"):
        _load(path)
