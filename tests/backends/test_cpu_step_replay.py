"""Decode steps recorded once and replayed in one native call (``backends/cpu_step_replay.py``,
``csrc/step_replay.c``) against the same steps run eagerly.

A replay runs the kernels the eager step ran, with the same arguments, in the same order, and plain copies,
adds and products by a scalar (rounded as torch rounds them) in place of the torch ops between them, so
everything is compared for exact equality: the greedy tokens and the top-5 logprobs of every step (the
logits' values) of tiny llama, qwen2, qwen3, mistral and Gemma 1-3 models, float32, bfloat16, float16 and
quantized (in-situ Q4_0: the fused int8 matmul; a llama.cpp Q8_0 file with its quantized embedding),
against ``enforce_eager``; with sequences finishing and joining between steps,
preemption and prefix caching. The translated torch ops one by one, on a stand-in forward: tests/backends/
test_cpu_step_recorder.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pluginfer import LLM, SamplingParams
from pluginfer.backends.cpu import amx_half, half_panels
from pluginfer.backends.cpu import half_linear as native_half_linear
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu.step_replay import CpuDecodeReplay
from tests.checkpoints import random_prompts, save_hf_model
from tests.models.family_cases_gemma_phi import CASES as GEMMA_PHI_CASES

pytestmark = pytest.mark.skipif(native.available() is not None, reason="the native kernels did not load")
PANELS = native.available() is None and native.op("panel_linear") is not None
# Without the panel GEMM (AVX-512) a float32 linear is oneDNN's, which the recorder refuses: those steps stay eager.
needs_panels = pytest.mark.skipif(not PANELS, reason="float32 decode steps replay through the AVX-512 panel GEMM")

FIXTURES = Path(__file__).parent.parent / "quant" / "fixtures"
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5)
MODELS = {"llama": ("LlamaForCausalLM", {}), "qwen2": ("Qwen2ForCausalLM", {}),  # qwen2: q/k/v biases
          "qwen3": ("Qwen3ForCausalLM", {"head_dim": 16}),  # q/k norms over views of the fused qkv output
          "mistral": ("MistralForCausalLM", {"sliding_window": 12}),
          # Gemma: the embedding scale (a product by a 0-dim tensor), the tanh GELU, norms with an offset;
          # Gemma 2: soft-capped attention, a window, post-norms; Gemma 3: q/k norms, local and global layers
          "gemma": GEMMA_PHI_CASES["gemma"], "gemma2": GEMMA_PHI_CASES["gemma2-softcap-window-12"],
          "gemma3": GEMMA_PHI_CASES["gemma3-local-global-window-8"]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    paths = {}
    for name, (arch, extra) in MODELS.items():
        paths[name] = tmp_path_factory.mktemp(name)
        save_hf_model(arch, {**SHAPE, **extra}, paths[name], tiny_tokenizer_dir)
    return paths


def run(path: Path, eager: bool, schedule: list[list[tuple[list[int], int]]], **options: object) -> tuple[dict, object]:
    """Greedy tokens and top-5 logprobs per request; ``schedule[i]`` are the (prompt, max_tokens) added
    before step ``i`` (later requests join running ones). Also the replay object (None when eager)."""
    options = {"max_model_len": 128, "max_num_seqs": 8, "enable_prefix_caching": False, **options}
    if not str(path).endswith(".gguf"):
        options.setdefault("dtype", "float32")
    results: dict[str, tuple] = {}
    with LLM(str(path), enforce_eager=eager, **options) as llm:
        engine = llm.engine
        step = 0
        while step < len(schedule) or engine.has_unfinished_requests():
            for prompt, max_tokens in schedule[step] if step < len(schedule) else []:
                engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                          logprobs=5))
            for output in engine.step():
                if output.finished:
                    completion = output.outputs[0]
                    results[output.request_id] = (completion.token_ids, completion.logprobs)
            step += 1
        replay = engine.executor.worker.decode_graphs
        preemptions = engine.scheduler.num_preemptions
    return {"results": results, "preemptions": preemptions}, replay


def schedule(vocab: int = 200) -> list[list[tuple[list[int], int]]]:
    """Three requests that finish at different steps, two that join later: decode batches of 1 to 4."""
    prompts = random_prompts(vocab, [5, 11, 3, 7, 9], seed=3)
    return [[(prompts[0], 20), (prompts[1], 6), (prompts[2], 12)], [], [], [], [(prompts[3], 9)], [], [], [],
            [(prompts[4], 14)]]


def assert_replayed_like_eager(path: Path, plan: list, **options: object) -> object:
    replayed, replay = run(path, False, plan, **options)
    eager, none = run(path, True, plan, **options)
    assert none is None  # enforce_eager: no replays on the cpu backend either
    assert isinstance(replay, CpuDecodeReplay) and replay.replays > 0
    assert replayed["results"] == eager["results"]  # tokens and logprobs, exactly
    assert replayed["preemptions"] == eager["preemptions"]
    return replay, replayed


@needs_panels
@pytest.mark.parametrize("name", list(MODELS))
def test_replayed_decode_equals_eager(name: str, checkpoints: dict[str, Path]) -> None:
    replay, _ = assert_replayed_like_eager(checkpoints[name], schedule())
    recorded = {size for size, program in replay.programs.items() if program is not None}
    assert len(recorded) >= 3, replay.programs  # several batch sizes, each recorded once and replayed


def test_bfloat16_decode_equals_eager(checkpoints: dict[str, Path]) -> None:
    """bfloat16: the 16-bit kernels (attention, norms, rotary, SiLU, the GEMV) and the final bfloat16 add,
    which step_replay.c rounds as torch does."""
    replay, _ = assert_replayed_like_eager(checkpoints["qwen2"], schedule(), dtype="bfloat16")
    recorded = {size for size, program in replay.programs.items() if program is not None}
    assert len(recorded) >= 3, replay.programs  # several batch sizes, each recorded once and replayed


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_float16_decode_equals_eager(name: str, checkpoints: dict[str, Path]) -> None:
    """float16: the same 16-bit kernels as bfloat16, and the final float16 add (``add_f16``), which
    step_replay.c rounds as torch does."""
    replay, _ = assert_replayed_like_eager(checkpoints[name], schedule(), dtype="float16")
    recorded = {size: program for size, program in replay.programs.items() if program is not None}
    assert len(recorded) >= 3, replay.programs  # several batch sizes, each recorded once and replayed
    assert all("add_f16" in program[0].names for program in recorded.values())


@needs_panels
@pytest.mark.parametrize(("name", "head_recorded"), [("llama", True), ("gemma", False), ("gemma2", False)])
def test_lm_head_replayed_after_the_layers(name: str, head_recorded: bool, checkpoints: dict[str, Path]) -> None:
    """The worker hands the forward with its LM head (``DecodeForward``): the head is recorded after the layers
    and a replay gives the logits (llama's float32 head on the native panels); where the head's recording is
    refused (Gemma's tied float32 head is torch's ``linear`` over the embedding, Gemma 2 adds the final
    soft-capping ``tanh``) the layers are replayed and the head runs eagerly after them. Either way the steps
    equal --enforce-eager's exactly."""
    replay, _ = assert_replayed_like_eager(checkpoints[name], schedule())
    vocab = json.loads((checkpoints[name] / "config.json").read_text())["vocab_size"]
    recorded = {size: program for size, program in replay.programs.items() if program is not None}
    assert len(recorded) >= 3, replay.programs
    assert replay.eager_head == (set() if head_recorded else set(recorded))
    for size, (_, out, _) in recorded.items():
        assert out.shape == (size, vocab if head_recorded else SHAPE["hidden_size"]) and out.dtype == torch.float32


@needs_panels
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_float32_model_with_a_16_bit_kv_cache_replays_like_eager(kv_dtype: str,
                                                                checkpoints: dict[str, Path]) -> None:
    """A float32 llama with ``kv_cache_dtype`` float16/bfloat16: the keys and values rounded into the cache
    (``from_f32`` + ``scatter_rows``) and the float32 query attending over it (``paged_decode_attention_kv16``)
    are recorded, and the replayed steps equal --enforce-eager's exactly."""
    replay, _ = assert_replayed_like_eager(checkpoints["llama"], schedule(), kv_cache_dtype=kv_dtype)
    recorded = {size: program for size, program in replay.programs.items() if program is not None}
    assert len(recorded) >= 3, replay.programs  # several batch sizes, each recorded once and replayed
    for program in recorded.values():
        assert {"paged_decode_attention_kv16", "from_f32", "scatter_rows"} <= set(program[0].names)
        assert "paged_decode_attention" not in program[0].names


@needs_panels
@pytest.mark.parametrize(("dtype", "kv_dtype"), [("float32", "int8"), ("float32", "fp8"), ("bfloat16", "int8")])
def test_a_quantized_kv_cache_replays_like_eager(dtype: str, kv_dtype: str, checkpoints: dict[str, Path]) -> None:
    """A quantized KV cache (``kv_cache_dtype`` int8 / fp8): the write that quantizes this step's keys and values
    (``kv_quantize_rows``) and the attention over the codes (``paged_attention_quantized``) are recorded, and the
    replayed steps equal --enforce-eager's exactly."""
    replay, _ = assert_replayed_like_eager(checkpoints["llama"], schedule(), dtype=dtype, kv_cache_dtype=kv_dtype)
    recorded = {size: program for size, program in replay.programs.items() if program is not None}
    assert len(recorded) >= 3, replay.programs
    for program in recorded.values():
        assert {"kv_quantize_rows", "paged_attention_quantized"} <= set(program[0].names)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_gemma_decode_equals_eager(dtype: str, checkpoints: dict[str, Path]) -> None:
    """Gemma 2 in 16 bits: the embedding scale rounded as torch rounds it (``mul_scalar``), the 16-bit tanh GELU."""
    replay, _ = assert_replayed_like_eager(checkpoints["gemma2"], schedule(), dtype=dtype)
    recorded = [program for program in replay.programs.values() if program is not None]
    assert len(recorded) >= 3, replay.programs
    assert all({"mul_scalar", "gelu_tanh_and_mul_16"} <= set(program[0].names) for program in recorded)


def test_quantized_decode_equals_eager(checkpoints: dict[str, Path]) -> None:
    """In-situ Q4_0: every linear through the fused int8-activation matmul (csrc/quant_dot.c) where this CPU
    has it, the dequantizing path otherwise; a llama.cpp Q8_0 file: its quantized embedding too."""
    assert_replayed_like_eager(checkpoints["llama"], schedule(), quant="q4_0")
    gguf = FIXTURES / "llamacpp-llama-q8_0.gguf"
    assert_replayed_like_eager(gguf, schedule(vocab=250))


@pytest.mark.parametrize("layout", ["stored", "panels"])
def test_gguf_f16_decode_equals_eager(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's F16 file in a float32 model: the linears' and the head's 16-bit weights read in place
    (half_weight_linear, a replay entry) or packed into the 16-bit panels where the CPU has AVX-512 and no AMX
    (half_panel_linear), the embedding's F16 rows widened after their gather (to_f32)."""
    if native_half_linear.half_linear_isa() is None:
        pytest.skip("no native 16-bit GEMV here")
    if layout == "stored":
        monkeypatch.setitem(native.NATIVE, "ggml_half_pack", lambda weight: None)
    elif not half_panels.supported():
        pytest.skip("no 16-bit panel GEMM here (it needs AVX-512F)")
    else:
        monkeypatch.setattr(amx_half, "library", lambda: None)
    replay, _ = assert_replayed_like_eager(FIXTURES / "llamacpp-llama-f16.gguf", schedule(vocab=250))
    names = replay.programs[1][0].names
    kernel = "half_weight_linear" if layout == "stored" else "half_panel_linear"
    assert kernel in names and "to_f32" in names, names


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gguf_f16_decode_in_a_16_bit_model_equals_eager(dtype: str) -> None:
    """The same file in a 16-bit model: its linears through the 16-bit GEMV as an HF checkpoint's; in bfloat16
    the embedding's F16 rows widened, then rounded to bfloat16 (``from_f32``)."""
    if native_half_linear.half_linear_isa() is None:
        pytest.skip("no native 16-bit GEMV here")
    replay, _ = assert_replayed_like_eager(FIXTURES / "llamacpp-llama-f16.gguf", schedule(vocab=250), dtype=dtype)
    names = replay.programs[1][0].names
    assert names.count("half_linear") >= 4, names  # 4 a layer
    assert ("from_f32" in names) == (dtype == "bfloat16"), names


def test_w8a8_decode_equals_eager(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """A W8A8 compressed-tensors checkpoint: its linears run int8_gemm.c's GEMM, a library of its own, which the
    program calls through its address (``int8_gemm_at``)."""
    pytest.importorskip("compressed_tensors")
    from pluginfer.backends.cpu import int8_gemm
    from tests.conftest import TINY_LLAMA
    from tests.quant.compressed_tensors_checkpoints import save_w8a8_checkpoint

    if int8_gemm.load() is None:
        pytest.skip("the W8A8 int8 GEMM did not build here")
    model = save_hf_model("LlamaForCausalLM", TINY_LLAMA, tmp_path / "float", tiny_tokenizer_dir)
    path = save_w8a8_checkpoint(model, tmp_path / "w8a8", tiny_tokenizer_dir)
    replay, _ = assert_replayed_like_eager(path, schedule())
    names = replay.programs[1][0].names
    assert names.count("int8_gemm_at") >= 4, names  # qkv, o, gate_up, down a layer


def test_batches_on_amx_tiles_are_replayed_through_the_kernels_address(checkpoints: dict[str, Path]) -> None:
    """From amx_quant.MIN_ROWS rows the fused matmul runs on AMX tiles, a kernel of another library: the
    program calls it through its address (``quant_matmul_at``); batches of 8 down to 1 all replay."""
    from pluginfer.backends.cpu import amx_quant

    if not amx_quant.takes(2, 8):
        pytest.skip("no AMX int8 tiles here (or PLUGINFER_AMX=0)")
    prompts = random_prompts(200, [4] * 8, seed=7)
    plan = [[(prompt, 4 + 2 * index) for index, prompt in enumerate(prompts)]]  # batches of 8 down to 1
    replay, _ = assert_replayed_like_eager(checkpoints["llama"], plan, quant="q4_0")
    for size in range(1, 9):
        names = replay.programs[size][0].names
        assert ("quant_matmul_at" in names) == amx_quant.takes(2, size), (size, names)


def test_float32_batches_against_f16_weights_on_amx_tiles_are_replayed_through_the_kernels_address() -> None:
    """llama.cpp's F16 file in a float32 model: from amx_half.FLOAT_X_MIN_ROWS rows its linears and head run on
    AMX bfloat16 tiles with x split in two (``amx_half_weight_linear``, another library): the program calls it
    through its address (``half_linear_at``), half_weight_linear below; batches of 16 down to 1 replay and
    equal --enforce-eager."""
    from pluginfer.backends.cpu import amx_half

    if not amx_half.takes_float_x(torch.float16, 16):
        pytest.skip("no AMX bfloat16 tiles here (or PLUGINFER_AMX=0)")
    prompts = random_prompts(250, [4] * 16, seed=9)
    plan = [[(prompt, 4 + 2 * index) for index, prompt in enumerate(prompts)]]  # batches of 16 down to 1
    replay, _ = assert_replayed_like_eager(FIXTURES / "llamacpp-llama-f16.gguf", plan, max_num_seqs=16)
    for size in range(1, 17):
        names = replay.programs[size][0].names
        assert ("half_linear_at" in names) == amx_half.takes_float_x(torch.float16, size), (size, names)
        assert ("half_weight_linear" in names) != amx_half.takes_float_x(torch.float16, size), (size, names)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_batches_on_amx_tiles_are_replayed_through_the_kernels_address(
        dtype: torch.dtype, checkpoints: dict[str, Path]) -> None:
    """From amx_half.MIN_ROWS rows a 16-bit linear runs on AMX bfloat16 tiles (csrc/amx_half.c, a library of
    its own; float16 split in two): the program calls it through its address (``half_linear_at``); batches
    of 8 down to 1 all replay, and equal --enforce-eager."""
    from pluginfer.backends.cpu import amx_half

    if not amx_half.takes(dtype, 8):
        pytest.skip("no AMX bfloat16 tiles here (or PLUGINFER_AMX=0)")
    prompts = random_prompts(200, [4] * 8, seed=7)
    plan = [[(prompt, 4 + 2 * index) for index, prompt in enumerate(prompts)]]  # batches of 8 down to 1
    replay, _ = assert_replayed_like_eager(checkpoints["qwen2"], plan, dtype=str(dtype).removeprefix("torch."))
    for size in range(1, 9):
        names = replay.programs[size][0].names
        assert ("half_linear_at" in names) == amx_half.takes(dtype, size), (size, names)


@needs_panels
def test_preemption_and_prefix_caching(checkpoints: dict[str, Path]) -> None:
    """A cache too small for all requests (the newest are preempted and recomputed), then requests that
    share a cached prefix: block tables and slots change under the recorded programs."""
    _, replayed = assert_replayed_like_eager(checkpoints["llama"], schedule(), num_blocks=8, block_size=4,
                                                   max_model_len=32)
    assert replayed["preemptions"] > 0
    prefix = random_prompts(200, [16], seed=5)[0]
    shared = [[(prefix + [11, 12], 10), (prefix + [13], 8)], [], [], [(prefix + [14, 15, 16], 6)]]
    assert_replayed_like_eager(checkpoints["qwen2"], shared, enable_prefix_caching=True, block_size=4)


@pytest.mark.skipif(PANELS, reason="the panel GEMM is built here: float32 steps replay (the tests above)")
def test_float32_steps_stay_eager_without_the_panel_gemm(checkpoints: dict[str, Path]) -> None:
    """An AVX2-only CPU: the recorder refuses oneDNN's packed GEMM, so no float32 step is replayed, and the
    tokens and logprobs are --enforce-eager's."""
    replayed, replay = run(checkpoints["llama"], False, schedule())
    eager, _ = run(checkpoints["llama"], True, schedule())
    assert isinstance(replay, CpuDecodeReplay) and replay.replays == 0
    assert replayed == eager
