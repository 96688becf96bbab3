"""The model conformance kit (``pluginfer.testing.model_contract``) passes the built-in llama pipeline and the
example out-of-tree Granite plugin against transformers, and fails a pipeline with a bug naming what broke."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers

from pluginfer.core.hookspecs import hookimpl
from pluginfer.core.registry import get_registry
from pluginfer.core.specs import ModelSpec
from pluginfer.testing.model_contract import check_model_pipeline
from tests.conftest import TINY_LLAMA
from tests.test_example_plugin import GRANITE


def test_llama() -> None:
    report = check_model_pipeline(transformers.LlamaForCausalLM, TINY_LLAMA, plugin="llama")
    assert report["max_logit_error"] < 1e-4 and len(report["tokens"]) == 3


def test_granite_example_plugin() -> None:
    if importlib.util.find_spec("pluginfer_granite") is None:
        pytest.skip("plugins/pluginfer-example-granite is not installed (pip install -e ./plugins/...)")
    check_model_pipeline(transformers.GraniteForCausalLM, GRANITE, plugin="granite")


def test_an_architecture_served_by_another_plugin_is_named() -> None:
    with pytest.raises(AssertionError, match=r"ModelPipeline \(LlamaForCausalLM\): the architecture resolves to the "
                                             r"model plugin 'llama', not 'granite'"):
        check_model_pipeline(transformers.LlamaForCausalLM, TINY_LLAMA, plugin="granite")


def build_with_warm_logits(hf_config: dict, ctx: Any) -> torch.nn.Module:
    """The llama pipeline with a bug: logits scaled by 1.01 (a temperature applied twice, say)."""
    pipeline = get_registry().load("model", "llama")(hf_config, ctx)
    compute_logits = pipeline.compute_logits
    pipeline.compute_logits = lambda hidden: compute_logits(hidden) * 1.01
    return pipeline


@pytest.fixture
def broken_llama() -> Iterator[None]:
    """An in-process model plugin that overrides the llama architecture, unregistered afterwards."""
    spec = ModelSpec(name="warm-llama", architectures=("LlamaForCausalLM",), overrides=True,
                      factory=f"{__name__}:build_with_warm_logits")
    plugin = type("WarmLlamaPlugin", (), {"pluginfer_models": hookimpl(lambda self: [spec])})()
    registry = get_registry()
    registry.register(plugin, name="warm-llama")
    try:
        yield
    finally:
        registry.unregister("warm-llama")


def test_a_pipeline_with_a_bug_fails_naming_the_member(broken_llama: None) -> None:
    with pytest.raises(AssertionError, match=r"ModelPipeline\.forward \+ compute_logits \(LlamaForCausalLM, prompt 0 "
                                             r"of 7 tokens\): prefill logits differ from transformers'"):
        check_model_pipeline(transformers.LlamaForCausalLM, TINY_LLAMA, plugin="warm-llama")
