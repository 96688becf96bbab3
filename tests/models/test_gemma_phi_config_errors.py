"""Config fields the gemma and phi pipelines do not support fail at build, naming the field and value."""

from __future__ import annotations

import pytest

from pluginfer.backends.cpu import backend as cpu
from pluginfer.layers.context import building
from pluginfer.models import gemma, phi
from tests.layers.conftest import make_context

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64, head_dim=16)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}

# name: (build function, architecture, config overrides, regex the error must match)
CASES = {
    "gemma-hidden-act": (gemma.build, "GemmaForCausalLM", {"hidden_act": "silu"}, r"hidden_act 'silu'"),
    "gemma2-hidden-activation": (gemma.build, "Gemma2ForCausalLM", {"hidden_activation": "relu", "sliding_window": 8},
                                 r"hidden_activation 'relu'"),
    "gemma2-layer-type": (gemma.build, "Gemma2ForCausalLM",
                          {"layer_types": ["sliding_attention", "chunked_attention"], "sliding_window": 8},
                          r"layer_types.*'chunked_attention'"),
    "gemma2-layer-count": (gemma.build, "Gemma2ForCausalLM",
                           {"layer_types": ["full_attention"], "sliding_window": 8}, r"layer_types must list 2"),
    "gemma2-no-window": (gemma.build, "Gemma2ForCausalLM", {"sliding_window": None}, r"sliding_window.*None"),
    "gemma2-soft-cap": (gemma.build, "Gemma2ForCausalLM", {"sliding_window": 8, "attn_logit_softcapping": -1.0},
                        r"attn_logit_softcapping.*-1\.0"),
    "gemma3-bidirectional": (gemma.build, "Gemma3ForCausalLM",
                             {"sliding_window": 8, "use_bidirectional_attention": True}, r"use_bidirectional_attention"),
    "gemma3-rope-type": (gemma.build, "Gemma3ForCausalLM",
                         {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                          "rope_parameters": {
                             "full_attention": {"rope_type": "mystery", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
                         r"rope_type.*'mystery'"),
    "gemma-architecture": (gemma.build, "GemmaModelOfTheFuture", {}, r"architectures.*GemmaModelOfTheFuture"),
    "phi2-hidden-act": (phi.build, "PhiForCausalLM", {"hidden_act": "mystery"}, r"hidden_act.*'mystery'"),
    "phi2-partial-rotary": (phi.build, "PhiForCausalLM", {"partial_rotary_factor": 1.5},
                            r"partial_rotary_factor.*1\.5"),
    "phi2-rope-type": (phi.build, "PhiForCausalLM", {"rope_scaling": {"rope_type": "mystery", "factor": 2.0}},
                       r"rope_type.*'mystery'"),
    "phi3-rope-type": (phi.build, "Phi3ForCausalLM", {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
                       r"rope_scaling\.rope_type 'dynamic'.*Phi3ForCausalLM"),
    "phi3-longrope-factors": (phi.build, "Phi3ForCausalLM",
                              {"rope_scaling": {**LONGROPE, "short_factor": [1.0] * 3}},
                              r"rope_scaling\.short_factor.*8 numbers"),
    "phi3-hidden-act": (phi.build, "Phi3ForCausalLM", {"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    "phi3-heads": (phi.build, "Phi3ForCausalLM", {"num_key_value_heads": 3}, r"num_key_value_heads 3"),
    "phi-architecture": (phi.build, "PhiMoEForCausalLM", {}, r"architectures.*PhiMoEForCausalLM"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_unsupported_field_fails_at_build_naming_it(name: str) -> None:
    build, architecture, overrides, message = CASES[name]
    ctx = make_context(cpu.build(), max_model_len=64)
    config = {**TINY, "architectures": [architecture], **overrides}
    with building(ctx), pytest.raises(ValueError, match=message):
        build(config, ctx)


@pytest.mark.parametrize("build, architecture, overrides", [
    (gemma.build, "Gemma2ForCausalLM", {"sliding_window": 8}),
    (gemma.build, "Gemma3ForCausalLM", {"sliding_window": 8, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                        "sliding_window_pattern": 2}),
    (phi.build, "Phi3ForCausalLM", {"rope_scaling": {**LONGROPE, "type": "su"}, "original_max_position_embeddings": 32}),
], ids=["gemma2-hub-defaults", "gemma3-hub-rope-fields", "phi3-su"])
def test_hub_style_configs_build(build, architecture: str, overrides: dict) -> None:
    """The fields hub checkpoints carry (before transformers 5 rewrote them) are read, not rejected."""
    ctx = make_context(cpu.build(), max_model_len=64)
    with building(ctx):
        pipeline = build({**TINY, "architectures": [architecture], **overrides}, ctx)
    assert pipeline.kv_cache_spec().num_layers == 2
