"""16-bit models through the engine on the native GEMV (``csrc/half_linear.c``) against the torch path.

A llama (and a qwen2, whose q/k/v biases the kernel adds) checkpoint run with ``dtype`` bfloat16 / float16: every linear (qkv, o, gate_up, down, the
untied LM head) keeps its ``[out, in]`` weight in the cpu backend's ``half`` layout. A prompt no longer
than the kernel's row limit runs every linear through the kernel (from ``amx_half.MIN_ROWS`` rows, where the CPU
has AMX-BF16, on the tiles of ``csrc/amx_half.c``); the same engine with both limits at 0 runs them all through
``F.linear`` (the torch path it replaces). Both round every op to the model's
dtype and sum in float32 in different orders, so their logits differ by a few 16-bit steps: the bound
is a fraction of the float32 logits' spread, about twice the largest difference measured here (in
the comments); transformers' float32 model is the oracle both stay close to.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pluginfer import LLM
from pluginfer.backends.cpu import amx_half
from pluginfer.backends.cpu import half_linear as native_half_linear
from pluginfer.backends.cpu import ops as native
from tests.checkpoints import greedy, hf_logits, prefill_logits, random_prompts, save_hf_model

pytestmark = pytest.mark.skipif(native.available() is not None or native_half_linear.half_linear_isa() is None,
                                reason="the 16-bit GEMV needs AVX2 + FMA + F16C (and the native library)")

LLAMA = dict(hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, initializer_range=0.05, rms_norm_eps=1e-5, tie_word_embeddings=False)
# qwen2: biases on q, k and v, added by the kernel
MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# max |ours - torch path| / spread of the float32 logits, over 4 seeds: bfloat16 measured 0.096 % (most
# prompts 0: the same rounded outputs), float16 0.051 %; prompts of 1 token and of the row limit
PATH_BOUND = {torch.bfloat16: 0.002, torch.float16: 0.001}
# max |ours - transformers float32| / spread: bfloat16 measured 0.51 %, float16 0.070 % (the torch path's alike)
ORACLE_BOUND = {torch.bfloat16: 0.01, torch.float16: 0.0015}


@pytest.fixture(scope="module", params=list(MODELS))
def llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          tiny_tokenizer_dir: Path) -> tuple[Path, torch.nn.Module]:
    out = tmp_path_factory.mktemp(f"half_{request.param}")
    return out, save_hf_model(MODELS[request.param], LLAMA, out, tiny_tokenizer_dir)


class Calls:
    """Counts native_half_linear.half_linear calls, and the row counts it took (not None)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        kernel = native_half_linear.half_linear

        def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
            out = kernel(x, weight, bias)
            if out is not None:
                self.rows.append(x.numel() // x.shape[-1])
            return out

        monkeypatch.setattr(native_half_linear, "half_linear", counted)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_logits_on_the_native_gemv_equal_the_torch_path_within_the_bound(
        dtype: torch.dtype, llama: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    path, model = llama
    calls = Calls(monkeypatch)
    llm = LLM(model=str(path), dtype=str(dtype).removeprefix("torch."), num_blocks=32, block_size=8)
    limit = native_half_linear.HALF_LINEAR_MAX_ROWS[dtype]
    for prompt in random_prompts(model.config.vocab_size, [1, limit], seed=3):
        calls.rows.clear()
        ours = prefill_logits(llm, prompt).float()
        # every linear of both layers and the head: 2 x (qkv, o, gate_up, down) + 1
        assert calls.rows == [len(prompt)] * 9
        with monkeypatch.context() as torch_path:
            torch_path.setitem(native_half_linear.HALF_LINEAR_MAX_ROWS, dtype, 0)
            torch_path.setitem(amx_half.MAX_ROWS, dtype, 0)  # nor the AMX tiles (from amx_half.MIN_ROWS rows)
            theirs = prefill_logits(llm, prompt).float()
        assert calls.rows == [len(prompt)] * 9  # the torch path did not call the kernel
        reference = hf_logits(model, prompt)
        spread = (reference.max() - reference.min()).item()
        assert (ours - theirs).abs().max().item() < PATH_BOUND[dtype] * spread
        assert (ours - reference).abs().max().item() < ORACLE_BOUND[dtype] * spread


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_batched_decode_runs_on_the_native_gemv(dtype: torch.dtype, llama: tuple[Path, torch.nn.Module],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences decoding together: every step's linears take 3 rows through the kernel, and a
    sequence's tokens are the ones it gets decoding alone (a row's result does not depend on its batch).
    Prompts of 2 tokens: the three prefills together (6 rows) stay under the row limit too, so no linear
    runs torch's GEMM, whose rows may round differently with the row count."""
    path, model = llama
    calls = Calls(monkeypatch)
    llm = LLM(model=str(path), dtype=str(dtype).removeprefix("torch."), num_blocks=64, block_size=8)
    prompts = random_prompts(model.config.vocab_size, [2, 2, 2], seed=4)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12))]
    assert 3 in calls.rows and 6 in calls.rows
    alone = [llm.generate([prompt], greedy(12))[0].outputs[0].token_ids for prompt in prompts]
    assert together == alone
