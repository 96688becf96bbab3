"""The whole engine on the cuda backend: its Triton kernels run by Triton's interpreter on CPU tensors, and,
where torch sees a CUDA device, the same cases again compiled for the GPU (target ``gpu``, decode steps
replaying real CUDA graphs).

Each case builds a tiny random Hugging Face checkpoint, asks transformers for its greedy continuations
(the oracle), and runs ``tests/backends/cuda_interpreted.py`` in a fresh interpreter with
``TRITON_INTERPRET=1 PLUGINFER_CUDA_ON_CPU=1`` (on the GPU, neither) and ``backend="cuda"``. The prompts come in two groups
generated one after the other: the second shares the first's prefix (prefix-cache hits, whose
prefill reads the cached blocks) and the step budget of 16 tokens cuts longer prompts into chunks
(chunked prefill over cached blocks). Decode rows and prefill rows share steps. The greedy tokens
must equal transformers', and the Triton kernels each case needs must have run. The Marlin case
compares against the cpu backend (same checkpoint, the torch dequantize path) instead.

The interpreter proves the kernels and the backend's plumbing on any machine; the ``gpu`` target proves
CUDA compilation, native bf16/fp16 dots and graph capture, and is skipped where there is no GPU (it ran on
an H100: docs/performance.md, "On a GPU").
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.backends.cuda_interpreted import environment
from tests.checkpoints import hf_greedy, random_prompts, save_hf_model
from tests.models.family_cases_deepseek import MLA
from tests.models.test_families import BASE
from tests.models.test_families import CASES as FAMILIES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the test extra has it)")

RUNNER = Path(__file__).parent / "cuda_interpreted.py"
ENGINE = dict(dtype="float32", num_blocks=96, block_size=8, max_num_batched_tokens=16)
MAX_TOKENS = 8
# Where the cuda backend runs: Triton's interpreter on CPU tensors (any machine), or compiled for a real GPU.
TARGETS = ["interpreter", pytest.param("gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="no CUDA device"))]
# Kernels every case runs: the KV write and both attention kernels.
COMMON = {"write_kv", "paged_decode_attention", "paged_prefill_attention"}

# name: (architecture, config overrides, kernels that must have run besides COMMON)
CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}, {"rms_norm", "rotary_neox", "silu_and_mul"}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {"head_dim": 16}, {"rms_norm", "rotary_neox", "silu_and_mul"}),
    "gemma2-softcap-window": ("Gemma2ForCausalLM", {
        "num_hidden_layers": 2, "head_dim": 16, "sliding_window": 12, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 2.0}, {"rms_norm", "rotary_neox", "gelu_and_mul"}),
    "mixtral-window": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                              "sliding_window": 16}, {"rms_norm", "rotary_neox", "fused_moe"}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                          "head_dim": 16, "norm_topk_prob": True}, {"rms_norm", "rotary_neox", "fused_moe"}),
    # LayerNorm, q/k/v bias, a LayerNorm per head on q and k, parallel residual, rope on half of each head: on
    # an H100 its greedy tokens left transformers' (docs/performance.md, "On a GPU"), under the interpreter not.
    "stablelm-qk-layernorm-parallel": ("StableLmForCausalLM", {
        "use_qkv_bias": True, "qk_layernorm": True, "use_parallel_residual": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
        {"rotary_neox", "silu_and_mul"}),
    "deepseek-v2-lite-mla": ("DeepseekV2ForCausalLM", {
        **MLA, "num_hidden_layers": 2, "q_lora_rank": None, "n_routed_experts": 6, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "topk_method": "greedy", "first_k_dense_replace": 1, "moe_intermediate_size": 24},
        {"rms_norm", "rotary_interleaved", "silu_and_mul", "fused_moe"}),
}


def run_engine(tmp_path: Path, model: Path, prompt_groups: list[list[list[int]]], backend: str = "cuda",
               decode_graphs: bool = False, target: str = "interpreter", poison_allocations: bool = False,
               adapters: list[list[str | None]] | None = None, **engine: object) -> dict:
    spec = tmp_path / f"spec-{backend}.json"
    spec.write_text(json.dumps({"model": str(model), "backend": backend, "engine": {**ENGINE, **engine},
                                "prompt_groups": prompt_groups, "max_tokens": MAX_TOKENS, "adapters": adapters,
                                "decode_graphs": decode_graphs, "poison_allocations": poison_allocations}))
    # Float activations for GGML blocks on the cpu backend too (its default for short steps quantizes them to
    # int8, which the cuda kernels do not): both backends then compute the same products.
    env = dict(environment(interpret=target == "interpreter"), PLUGINFER_QUANT_ACTIVATIONS="float")
    done = subprocess.run([sys.executable, str(RUNNER), str(spec)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def prompt_groups(vocab: int) -> list[list[list[int]]]:
    shared = random_prompts(vocab, [24], seed=2)[0]
    first = [shared, *random_prompts(vocab, [3, 11], seed=1)]
    second = [shared + tail for tail in random_prompts(vocab, [5, 1], seed=3)]
    return [first, second]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_on_cuda_backend_equals_transformers(name: str, target: str, tmp_path: Path,
                                                    tiny_tokenizer_dir: Path) -> None:
    arch, overrides, kernels = CASES[name]
    model = save_hf_model(arch, {**BASE, **overrides}, tmp_path / name, tiny_tokenizer_dir)
    groups = prompt_groups(model.config.vocab_size)
    expected = [[hf_greedy(model, prompt, MAX_TOKENS) for prompt in group] for group in groups]
    report = run_engine(tmp_path, tmp_path / name, groups, target=target)
    assert (report["backend"], report["device"]) == ("cuda", "cpu" if target == "interpreter" else "cuda:0")
    assert report["tokens"] == expected, name
    if target == "gpu":  # the greedy tokens above came through real CUDA graphs' replays
        assert report["graph_replays"] >= MAX_TOKENS - 2, report["graph_replays"]
    assert all(count >= 16 for count in report["cached_tokens"][1]), report["cached_tokens"]  # prefix hits
    missing = (COMMON | kernels) - set(report["kernel_calls"])
    assert not missing, f"{name}: Triton kernels that never ran: {sorted(missing)}"


@pytest.mark.parametrize("target", TARGETS)
def test_lora_adapters_through_the_grouped_kernel(target: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Two peft adapters of ranks 4 and 8 and the base model mixed in each step: the Triton ``lora_sgmv`` (reached
    through ``DeviceBackend.op``) gives peft's greedy tokens."""
    from tests.engine.test_lora import ALL_TARGETS, save_adapter

    model = save_hf_model("LlamaForCausalLM", BASE, tmp_path / "llama", tiny_tokenizer_dir)
    adapters = {"wide": save_adapter(model, tmp_path / "wide", 1, r=8, lora_alpha=8, target_modules=ALL_TARGETS),
                "narrow": save_adapter(model, tmp_path / "narrow", 2, r=4, lora_alpha=16,
                                       target_modules=["q_proj", "v_proj", "down_proj"])}
    prompts = random_prompts(model.config.vocab_size, [5, 18, 9], seed=4)
    names = ["wide", None, "narrow"]
    expected = [hf_greedy(model if n is None else adapters[n], p, MAX_TOKENS) for n, p in zip(names, prompts)]
    assert expected[0] != hf_greedy(model, prompts[0], MAX_TOKENS)  # the adapters change the tokens
    paths = [None if n is None else str(tmp_path / n) for n in names]
    report = run_engine(tmp_path, tmp_path / "llama", [prompts], target=target, adapters=[paths],
                        enable_lora=True, max_loras=2, max_lora_rank=8)
    assert report["tokens"] == [expected]
    assert report["kernel_calls"].get("lora_sgmv", 0) > 0


@pytest.mark.parametrize("target", TARGETS)
def test_marlin_through_the_backend_op_table(target: str, tmp_path: Path) -> None:
    """A GPTQModel checkpoint repacked to Marlin tiles: the Triton kernel (reached through
    ``DeviceBackend.op("marlin_matmul")``, no device test in the quant method) equals the cpu backend's torch path."""
    fixture = Path(__file__).parents[1] / "quant" / "fixtures" / "gptq_awq" / "gptq_b4_g128_sym"
    if not fixture.is_dir():
        pytest.skip(f"GPTQModel fixture {fixture} is missing (tests/quant/fixtures/make_gptq_awq.py)")
    vocab = json.loads((fixture / "config.json").read_text())["vocab_size"]
    groups = [random_prompts(vocab, [5, 18], seed=4)]
    on_cuda = run_engine(tmp_path, fixture, groups, quant="marlin", target=target)
    on_cpu = run_engine(tmp_path, fixture, groups, backend="cpu", quant="marlin")
    assert on_cuda["tokens"] == on_cpu["tokens"]
    assert on_cuda["kernel_calls"].get("marlin_matmul", 0) > 0
    assert "marlin_matmul" not in on_cpu["kernel_calls"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("quant", ["int8", "q4_0"])
def test_in_situ_quantized_formats_through_the_backend_op_table(quant: str, target: str, tmp_path: Path,
                                                               tiny_tokenizer_dir: Path) -> None:
    """A float checkpoint quantized at load (int8 W8A16, GGUF Q4_0 blocks): the cuda backend's kernels
    (``int8_matmul``, ``ggml_q4_0_matmul``, reached through the table) give the cpu backend's greedy tokens."""
    model = save_hf_model("LlamaForCausalLM", BASE, tmp_path / "llama", tiny_tokenizer_dir)
    groups = [random_prompts(model.config.vocab_size, [5, 18], seed=4)]
    on_cuda = run_engine(tmp_path, tmp_path / "llama", groups, quant=quant, target=target)
    on_cpu = run_engine(tmp_path, tmp_path / "llama", groups, backend="cpu", quant=quant)
    assert on_cuda["tokens"] == on_cpu["tokens"]
    kernel = {"int8": "int8_matmul", "q4_0": "ggml_q4_0_matmul"}[quant]
    assert on_cuda["kernel_calls"].get(kernel, 0) > 0


@pytest.mark.parametrize(("name", "quant"), [("gptq_b4_g128_sym", "gptq"), ("gptq_b8_gall_act_sym", "gptq"),
                                           ("awq_b4_g128", "awq")])
@pytest.mark.parametrize("target", TARGETS)
def test_gptq_and_awq_through_the_backend_op_table(name: str, quant: str, target: str, tmp_path: Path) -> None:
    """GPTQModel checkpoints on ``--quant gptq`` (4-bit; 8-bit with act-order) and ``--quant awq``: the Triton
    ``grouped_matmul`` gives the cpu backend's greedy tokens."""
    fixture = Path(__file__).parents[1] / "quant" / "fixtures" / "gptq_awq" / name
    if not fixture.is_dir():
        pytest.skip(f"GPTQModel fixture {fixture} is missing (tests/quant/fixtures/make_gptq_awq.py)")
    vocab = json.loads((fixture / "config.json").read_text())["vocab_size"]
    groups = [random_prompts(vocab, [5, 18], seed=4)]
    on_cuda = run_engine(tmp_path, fixture, groups, quant=quant, target=target)
    on_cpu = run_engine(tmp_path, fixture, groups, backend="cpu", quant=quant)
    assert on_cuda["tokens"] == on_cpu["tokens"]
    assert on_cuda["kernel_calls"].get("grouped_matmul", 0) > 0


@pytest.mark.parametrize("target", TARGETS)
def test_gguf_file_blocks_through_the_backend_op_table(target: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """A GGUF file of Q4_0 linears (F32 embedding and head): the cuda backend's ``ggml_q4_0_matmul`` gives the
    cpu backend's greedy tokens."""
    from pluginfer.cli.convert import convert_to_gguf

    model = save_hf_model("LlamaForCausalLM", BASE, tmp_path / "llama", tiny_tokenizer_dir)
    path = convert_to_gguf(tmp_path / "llama", tmp_path / "llama-q4_0.gguf", "q4_0", "f32")
    groups = [random_prompts(model.config.vocab_size, [5, 18], seed=4)]
    on_cuda = run_engine(tmp_path, path, groups, target=target)
    on_cpu = run_engine(tmp_path, path, groups, backend="cpu")
    assert on_cuda["tokens"] == on_cpu["tokens"]
    assert on_cuda["kernel_calls"].get("ggml_q4_0_matmul", 0) > 0


@pytest.mark.parametrize("target", TARGETS)
def test_q4_k_m_gguf_file_through_the_backend_op_table(target: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """A file of llama.cpp's Q4_K_M mix (Q4_K linears; Q6_K attn_v and ffn_down where its ``use_more_bits``
    picks them, here layer 1 of 2; F32 embedding and head) of a llama whose rows hold whole 256-weight
    super-blocks: the cuda backend's ``ggml_q4_k_matmul`` and ``ggml_q6_k_matmul`` (Q4_K and Q6_K groups in
    one fused qkv layer) give the cpu backend's greedy tokens."""
    from pluginfer.cli.convert import write_gguf
    from pluginfer.engine.loader import iter_weights, read_hf_config
    from pluginfer.text.tokenizer import load_tokenizer

    directory = tmp_path / "llama"
    model = save_hf_model("LlamaForCausalLM", {**BASE, "hidden_size": 256, "intermediate_size": 256}, directory,
                          tiny_tokenizer_dir)
    more_bits = {f"model.layers.1.{name}.weight": "q6_k" for name in ("self_attn.v_proj", "mlp.down_proj")}
    path = write_gguf(tmp_path / "llama-q4_k_m.gguf", read_hf_config(directory), load_tokenizer(directory),
                      iter_weights(directory), "q4_k", embedding_type="f32", types=more_bits)
    groups = [random_prompts(model.config.vocab_size, [5, 18], seed=4)]
    on_cuda = run_engine(tmp_path, path, groups, target=target)
    on_cpu = run_engine(tmp_path, path, groups, backend="cpu")
    assert on_cuda["tokens"] == on_cpu["tokens"]
    assert on_cuda["kernel_calls"].get("ggml_q4_k_matmul", 0) > 0
    assert on_cuda["kernel_calls"].get("ggml_q6_k_matmul", 0) > 0


# Every model family's cases (tests/models, 24 of them: windows, soft-caps, MLA, MoE routers, yarn, longrope,
# partial and interleaved rope, per-head norms) and Llama with dynamic NTK rope (per-step frequencies from the
# sequences' lengths): (architecture, config overrides on tests/models' BASE, weight edit before saving or None).
GRAPH_CASES = {**{name: (case[0], case[1], case[3] if len(case) > 3 else None) for name, case in FAMILIES.items()},
               "llama-dynamic-rope": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                                      None)}


@pytest.mark.slow  # 25 interpreted engines, ~8 s each
@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_decode_steps_through_the_graph_bookkeeping_equal_transformers(name: str, tmp_path: Path,
                                                                       tiny_tokenizer_dir: Path) -> None:
    """Decode steps replayed from ``DecodeGraphs``' static buffers (3 sequences padded to the bucket of 4, block
    tables at full width, the padding rows in the scratch KV block) through the real kernels give transformers'
    greedy tokens. The graph is a stand-in that re-runs the forward (no CUDA here), and its capture refuses what
    a CUDA capture refuses as far as CPU tensors show it (host reads of values, tensors made from host lists:
    ``CaptureRulesGraph``), so a model whose decode step could not be captured on a GPU fails here."""
    arch, overrides, edit = GRAPH_CASES[name]
    model = save_hf_model(arch, {**BASE, **overrides}, tmp_path / name, tiny_tokenizer_dir)
    if edit is not None:  # a case may change the model's weights before it is saved
        edit(model)
        model.save_pretrained(tmp_path / name, safe_serialization=True)
    groups = [random_prompts(model.config.vocab_size, [5, 11, 3], seed=5)]
    expected = [[hf_greedy(model, prompt, MAX_TOKENS) for prompt in group] for group in groups]
    report = run_engine(tmp_path, tmp_path / name, groups, decode_graphs=True, max_num_seqs=4, max_model_len=64)
    assert report["tokens"] == expected
    assert report["graph_replays"] >= MAX_TOKENS - 2  # every all-decode step replayed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graph_replays_equal_eager_decode_on_the_gpu(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Five sequences decode in the bucket of 8 (three padding rows in the scratch block): real CUDA graphs'
    replays give the eager steps' tokens (``enforce_eager``), and both give transformers'."""
    model = save_hf_model("LlamaForCausalLM", BASE, tmp_path / "llama", tiny_tokenizer_dir)
    groups = [random_prompts(model.config.vocab_size, [5, 11, 3, 7, 2], seed=5)]
    expected = [[hf_greedy(model, prompt, MAX_TOKENS) for prompt in group] for group in groups]
    graphs = run_engine(tmp_path, tmp_path / "llama", groups, target="gpu", max_num_seqs=8, max_model_len=64)
    eager = run_engine(tmp_path, tmp_path / "llama", groups, target="gpu", max_num_seqs=8, max_model_len=64,
                       enforce_eager=True)
    assert graphs["tokens"] == eager["tokens"] == expected
    assert graphs["graph_replays"] >= MAX_TOKENS - 2 and eager["graph_replays"] is None


@pytest.mark.parametrize("name", ["deepseek-v2-lite-mla", "gemma2-softcap-window"])
def test_no_kernel_reads_memory_it_never_wrote(name: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Every fresh tensor starts as NaN (floats) or -7777 (integers), as a GPU's reused memory would hold
    garbage: the greedy tokens stay transformers', so no kernel or layer reads output it never wrote (MLA's
    latent cache, fused MoE's sorted pairs, split decode attention's partial results, softcap and windows)."""
    arch, overrides, _ = CASES[name]
    model = save_hf_model(arch, {**BASE, **overrides}, tmp_path / name, tiny_tokenizer_dir)
    groups = prompt_groups(model.config.vocab_size)
    expected = [[hf_greedy(model, prompt, MAX_TOKENS) for prompt in group] for group in groups]
    assert run_engine(tmp_path, tmp_path / name, groups, poison_allocations=True)["tokens"] == expected
