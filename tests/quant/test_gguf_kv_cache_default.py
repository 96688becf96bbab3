"""A GGUF file's default KV cache: float16, llama.cpp's, while the model computes in float32 (dtype auto).

``dtype float32`` asked for by name, or ``kv_cache_dtype`` set, keeps what was asked; other checkpoints keep their
own dtype. The float16 cache rounds each cached key and value once: the logits move by that rounding alone, as
llama.cpp's do between its default F16 cache and an F32 one (the oracle: llama.cpp reading the same file).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pluginfer import LLM
from pluginfer.core.config import build_config
from pluginfer.core.registry import get_registry
from pluginfer.engine.launch import rank_info
from pluginfer.engine.plan import resolve_plan
from tests.checkpoints import prefill_logits, random_prompts

FILE = Path(__file__).parent / "fixtures" / "llamacpp-llama3-custom-f32.gguf"  # F32 weights: only the cache rounds
PROMPT = random_prompts(1000, [48], seed=21)[0]
# This random-weight model's logits move ~1e-2 (spread ~1.6) when its keys and values round to float16: measured
# 9.4e-3 ours, 1.0e-2 llama.cpp's between its F16 and F32 caches, 1.05e-2 between the two engines' F16 caches
# (llama.cpp also rounds each query to float16 for its product). Three times that bounds the rounding.
F16_CACHE_TOLERANCE = 3e-2


@pytest.mark.parametrize(("settings", "expected"), [
    ({}, torch.float16),
    ({"dtype": "float32"}, torch.float32),
    ({"dtype": "bfloat16"}, torch.bfloat16),
    ({"cache.kv_cache_dtype": "float32"}, torch.float32),
    ({"cache.kv_cache_dtype": "int8"}, torch.int8),
])
def test_a_gguf_files_cache_dtype(settings: dict, expected: torch.dtype) -> None:
    config = build_config(model=str(FILE), **settings)
    plan = resolve_plan(config, rank_info(config), get_registry())
    assert plan.kv_cache_dtype == expected
    assert plan.dtype == (torch.bfloat16 if settings.get("dtype") == "bfloat16" else torch.float32)


def test_a_float32_hugging_face_checkpoint_keeps_a_float32_cache(tiny_llama_checkpoint) -> None:
    config = build_config(model=str(tiny_llama_checkpoint[0]), dtype="float32")
    assert resolve_plan(config, rank_info(config), get_registry()).kv_cache_dtype == torch.float32


def test_the_default_cache_moves_logits_by_its_rounding_as_llama_cpps_does(tmp_path: Path) -> None:
    with LLM(model=str(FILE), num_blocks=64, block_size=8, max_model_len=256) as default:
        assert default.engine.executor.worker.kv_caches[0][0].dtype == torch.float16
        ours = prefill_logits(default, PROMPT)
    with LLM(model=str(FILE), num_blocks=64, block_size=8, max_model_len=256, kv_cache_dtype="float32") as exact:
        ours_exact = prefill_logits(exact, PROMPT)
    assert 0 < (ours - ours_exact).abs().max() <= F16_CACHE_TOLERANCE
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / FILE.name
    shutil.copy(FILE, path)
    model = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False,
                            n_threads=1)  # its default cache: F16 keys and values
    model.eval(PROMPT)
    theirs = torch.tensor(np.array(model.scores[: len(PROMPT)]), dtype=torch.float32)
    torch.testing.assert_close(ours, theirs, atol=F16_CACHE_TOLERANCE, rtol=0)
