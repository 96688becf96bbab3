"""resolve_plan: every choice a rank's build needs, made once from the config and the checkpoint's own
config.json, before anything is built; the built rank is what the plan says."""

from __future__ import annotations

import json

import pytest
import torch

from pluginfer.core.config import build_config
from pluginfer.core.registry import UnknownPluginError, get_registry
from pluginfer.engine.executor import start_rank
from pluginfer.engine.launch import rank_info
from pluginfer.engine.plan import resolve_plan


def test_the_plan_reads_the_checkpoint_and_the_built_rank_follows_it(tiny_llama_checkpoint) -> None:
    path = tiny_llama_checkpoint[0]
    written = json.loads((path / "config.json").read_text())
    config = build_config(model=str(path), max_model_len=48, **{"cache.num_blocks": 16, "cache.block_size": 8,
                                                                "cache.kv_cache_dtype": "bfloat16"})
    registry = get_registry()
    plan = resolve_plan(config, rank_info(config), registry)
    assert plan.model_path == path and plan.hf_config["vocab_size"] == written["vocab_size"]
    assert plan.model in {spec.name for spec in registry.specs("model")}
    assert plan.dtype == getattr(torch, written.get("torch_dtype") or written["dtype"])  # dtype auto: the file's
    assert (plan.kv_cache_dtype, plan.max_model_len, plan.max_blocks_per_seq) == (torch.bfloat16, 48, 6)
    assert plan.plugins == [("backend", plan.backend), ("model", plan.model), ("quant", plan.quant)]
    started = start_rank(config, rank_info(config), registry)
    try:
        worker = started.worker
        assert (worker.dtype, worker.kv_dtype, worker.max_model_len) == (plan.dtype, plan.kv_cache_dtype, 48)
        assert worker.backend.name == plan.backend and worker.kv_caches[0][0].dtype == torch.bfloat16
        assert next(worker.pipeline.parameters()).dtype == plan.dtype
        assert started.startup_times["config"] > 0
    finally:
        started.worker.world.close()


def test_a_choice_the_config_cannot_make_fails_before_anything_is_built(tiny_llama_checkpoint) -> None:
    path = tiny_llama_checkpoint[0]
    native = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    config = build_config(model=str(path), max_model_len=native + 1)
    with pytest.raises(ValueError, match=f"max_model_len: {native + 1} exceeds the model's max_position_embeddings"):
        resolve_plan(config, rank_info(config), get_registry())
    config = build_config(model=str(path), quant="no-such-quant")
    with pytest.raises(UnknownPluginError, match="no-such-quant"):
        resolve_plan(config, rank_info(config), get_registry())
