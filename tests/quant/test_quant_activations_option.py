"""The activations of GGUF-quantized linears as a config field and flag (``quant_activations``), over
``PLUGINFER_QUANT_ACTIVATIONS``: float is exact against transformers on the dequantized weights, int8 (the
default, as llama.cpp) is not; a bad value names the field or the variable; ``pluginfer plugins`` says which."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pluginfer import LLM
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.cli import build_parser, engine_config
from pluginfer.cli.convert import convert_to_gguf
from pluginfer.core.config import ConfigError, build_config, quant_activations
from tests.checkpoints import hf_logits, prefill_logits, random_prompts
from tests.quant.gguf_helpers import transformers_from_gguf

ENV = "PLUGINFER_QUANT_ACTIVATIONS"


@pytest.fixture(autouse=True)
def _configured_activations_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines built here set the process's configured activations; later tests find them as they were."""
    monkeypatch.setattr(native_quant, "_CONFIGURED_ACTIVATIONS", [None])


def _logits(path: Path, prompt: list[int], **kwargs: object) -> torch.Tensor:
    # a float32 KV cache, as the float32 oracle's (a GGUF file's default is float16, llama.cpp's)
    llm = LLM(model=str(path), num_blocks=64, block_size=8, kv_cache_dtype="float32", **kwargs)
    try:
        return prefill_logits(llm, prompt)
    finally:
        llm.close()


def test_the_config_field_picks_the_activations_over_the_environment(
        tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = convert_to_gguf(tiny_llama_checkpoint[0], tmp_path / "llama-q8_0.gguf", "q8_0", "f32")
    prompt = random_prompts(200, [20], seed=1)[0]
    oracle = hf_logits(transformers_from_gguf(path), prompt)
    monkeypatch.setenv(ENV, "int8")  # the config's field wins over the variable
    torch.testing.assert_close(_logits(path, prompt, quant_activations="float"), oracle, atol=1e-4, rtol=1e-4)
    if native.available() is None and native_quant.quant_dot_supported():  # the fused int8 kernel runs here
        monkeypatch.setenv(ENV, "float")
        int8 = _logits(path, prompt, quant_activations="int8")
        assert (int8 - oracle).abs().max() > 1e-4  # per-block int8 activations, as llama.cpp: not exact


def test_a_bad_value_names_the_field_or_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"quant_activations: Input should be 'int8' or 'float'"):
        build_config(model="m", quant_activations="half")
    with pytest.raises(ConfigError, match=r"PLUGINFER_QUANT_ACTIVATIONS='int4': expected 'int8' \(the default\) "
                                          r"or 'float'"):
        quant_activations(None, {ENV: "int4"})
    assert quant_activations(None, {}) == ("int8", "default")
    assert quant_activations(None, {ENV: "FLOAT"}) == ("float", ENV)
    assert quant_activations("int8", {ENV: "float"}) == ("int8", "quant_activations")
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", "--quant-activations", "float"])
    assert engine_config(args).quant_activations == "float"


def test_plugins_says_which_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    if native.available() is not None:
        pytest.skip(f"no native kernels here: {native.available()}")
    monkeypatch.delenv(ENV, raising=False)
    assert "GGUF linears take int8 activations (default; --quant-activations int8 or float)" in native.report()
    monkeypatch.setenv(ENV, "float")
    assert "GGUF linears take float activations (PLUGINFER_QUANT_ACTIVATIONS; " in native.report()
