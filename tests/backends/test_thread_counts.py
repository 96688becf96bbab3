"""A decode does not depend on the thread count: the C kernels keep small calls on the calling thread and split
larger ones by outputs or by rows, and each output
is computed the same way whichever thread takes it. So a tiny llama whose calls fall on both sides of those
thresholds (hidden 256: a 256 x 256 projection of one row stays on one thread, the 256 x 1536 gate-up splits;
at 16 rows the SiLU splits and the RMSNorm does not) gives the same greedy tokens and top-5 logprobs at 2
threads as at 1: float32 (panel GEMM), in-situ Q4_0 (the fused int8 matmul) and float16, batch 1 and 16,
replayed and eager.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pluginfer import LLM, SamplingParams
from pluginfer.backends.cpu import ops as native
from tests.checkpoints import random_prompts, save_hf_model

pytestmark = pytest.mark.skipif(native.available() is not None, reason="the native kernels did not load")

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("llama-256")
    save_hf_model("LlamaForCausalLM", SHAPE, path, tiny_tokenizer_dir)
    return path


def decode(path: Path, batch: int, eager: bool, **options: object) -> list[tuple]:
    prompts = random_prompts(200, [5 + i % 7 for i in range(batch)], seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    with LLM(str(path), enforce_eager=eager, max_model_len=128, max_num_seqs=16, enable_prefix_caching=False,
             **options) as llm:
        outputs = llm.generate(prompts, params)
        replay = llm.engine.executor.worker.decode_graphs
        assert eager or (replay is not None and replay.replays > 0)
    return [(output.outputs[0].token_ids, output.outputs[0].logprobs) for output in outputs]


@pytest.mark.parametrize("options", [{"dtype": "float32"}, {"dtype": "float32", "quant": "q4_0"},
                                     {"dtype": "float16"}], ids=["float32", "q4_0", "float16"])
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("eager", [False, True], ids=["replayed", "eager"])
def test_two_threads_decode_as_one(llama: Path, options: dict, batch: int, eager: bool,
                                   set_threads: Callable[[int], None]) -> None:
    set_threads(1)
    one = decode(llama, batch, eager, **options)
    set_threads(2)
    assert decode(llama, batch, eager, **options) == one  # tokens and logprobs, exactly
