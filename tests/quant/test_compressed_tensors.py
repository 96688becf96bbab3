"""W8A8 ``compressed-tensors`` checkpoints (written by compressed-tensors itself) against transformers' loading."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from pluginfer import LLM
from pluginfer.quant import compressed_tensors
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts, save_hf_model
from tests.conftest import TINY_LLAMA

pytest.importorskip("compressed_tensors")

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # qwen2: the q/k/v biases


def _checkpoints(root: Path, tokenizer_dir: Path, scheme: str) -> dict[str, Path]:
    from tests.quant.compressed_tensors_checkpoints import save_w8a8_checkpoint

    paths = {}
    for family, arch in FAMILIES.items():
        model = save_hf_model(arch, TINY_LLAMA, root / f"{family}-float", tokenizer_dir)
        paths[family] = save_w8a8_checkpoint(model, root / family, tokenizer_dir, scheme=scheme)
    return paths


@pytest.fixture(scope="module")
def w8a8_checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    return _checkpoints(tmp_path_factory.mktemp("w8a8"), tiny_tokenizer_dir, "W8A8")


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> dict[str, Path]:
    return _checkpoints(tmp_path_factory.mktemp("fp8"), tiny_tokenizer_dir, "FP8_DYNAMIC")


def load(path: Path) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8)


def linear_layers(llm: LLM) -> list[torch.nn.Module]:
    return [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "quant_method")]


def transformers_run(path: Path, fmt: str) -> tuple[torch.nn.Module, list[int], torch.Tensor, torch.Tensor]:
    """(transformers' model of the checkpoint, a prompt, its logits, its logits with float activations: what
    activation quantization moves)."""
    import transformers

    assert json.loads((path / "config.json").read_text())["quantization_config"]["format"] == fmt
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()  # decompresses, quantizes activations
    prompt = random_prompts(200, [40], seed=3)[0]
    reference = hf_logits(hf, prompt)
    for module in hf.modules():  # the same weights with float activations
        if hasattr(module, "quantization_scheme"):
            module.quantization_enabled = False
    float_activations = hf_logits(hf, prompt)
    for module in hf.modules():
        if hasattr(module, "quantization_scheme"):
            module.quantization_enabled = True
    assert (float_activations - reference).abs().max().item() > 0.1  # the activations are quantized in its run
    return hf, prompt, reference, float_activations


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(family: str, w8a8_checkpoints: dict[str, Path]) -> None:
    hf, prompt, reference, float_activations = transformers_run(w8a8_checkpoints[family], "int-quantized")
    llm = load(w8a8_checkpoints[family])
    assert linear_layers(llm)[0].quant_method.name == "compressed-tensors"  # quant auto chose it
    logits = prefill_logits(llm, prompt)
    # Both quantize each activation row as compressed-tensors does (scale = max|x| / 127.5). A row's most negative
    # element then sits exactly on the -127.5 tie, so its level (-127 or -128) follows the last bit of max|x|:
    # the residual stream summed in another order flips it, and this sharp random model (initializer_range 0.2)
    # carries the flip on through attention. So the bound is a fraction of what activation quantization itself
    # moves the logits (transformers with and without it): measured 0.17 (llama) and 0.005 (qwen2) of it on
    # average, 0.36 and 0.09 at the worst position.
    difference, moved = (logits - reference).abs(), (float_activations - reference).abs()
    assert difference.mean().item() <= 0.3 * moved.mean().item(), (difference.mean().item(), moved.mean().item())
    assert difference.max().item() <= 0.6 * moved.max().item(), (difference.max().item(), moved.max().item())
    assert llm.generate([prompt], greedy(12))[0].outputs[0].token_ids == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_logits_and_greedy_tokens_match_transformers(family: str, fp8_checkpoints: dict[str, Path]) -> None:
    """FP8_DYNAMIC (float8 weights per channel, float8 activations per token): compressed-tensors' own forward in
    transformers. Both round each activation to e4m3 from the same scale (max|x| / 448); a value near the middle
    of two e4m3 values rounds either way after a residual summed in another order, and float8's coarse steps
    carry that on, so the bound is a fraction of what activation quantization itself moves the logits."""
    path = fp8_checkpoints[family]
    hf, prompt, reference, float_activations = transformers_run(path, "float-quantized")
    llm = load(path)
    layers = linear_layers(llm)
    assert layers[0].quant_method.name == "compressed-tensors" and layers[0].fp8_weight.dtype == torch.bfloat16
    from safetensors.torch import load_file

    stored = load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
    o_proj = next(m for name, m in llm.engine.executor.pipeline.named_modules() if name.endswith("0.self_attn.o_proj"))
    assert stored.dtype == torch.float8_e4m3fn and torch.equal(o_proj.fp8_weight, stored.to(torch.bfloat16))
    logits = prefill_logits(llm, prompt)
    difference, moved = (logits - reference).abs(), (float_activations - reference).abs()
    # measured: llama 5e-7 mean (no flip), qwen2 0.0006 mean and 0.11 at its worst position (one flip), against
    # 0.15-0.17 mean and 1.4-2.3 at the worst that activation quantization moves
    assert difference.mean().item() <= 0.02 * moved.mean().item(), (difference.mean().item(), moved.mean().item())
    assert difference.max().item() <= 0.2 * moved.max().item(), (difference.max().item(), moved.max().item())
    assert llm.generate([prompt], greedy(12))[0].outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def test_fp8_linear_equals_its_reference_and_dequantized_weights() -> None:
    """The layer's path (the backend's 16-bit linear on the e4m3 levels) against the op's reference and against
    compressed-tensors' quantize-dequantize of the activations times the dequantized weight."""
    from pluginfer.backends.cpu import backend as cpu
    from pluginfer.collectives import single
    from pluginfer.core.protocols import BuildContext
    from pluginfer.layers.context import building
    from pluginfer.layers.linear import ReplicatedLinear

    torch.manual_seed(0)
    method = compressed_tensors.CompressedTensorsFP8()
    with building(BuildContext(backend=cpu.build(), quant=method, collective=single.build(), dtype=torch.float32,
                               max_model_len=64)):
        layer = ReplicatedLinear(96, 40, bias=True)
    weight = torch.randn(40, 96)
    scale = weight.abs().amax(dim=1, keepdim=True) / 448
    layer.weight.data.copy_((weight / scale).to(torch.float8_e4m3fn))
    layer.weight_scale.data.copy_(scale)
    layer.bias.data.copy_(torch.randn(40))
    levels = layer.weight.data.float()
    method.process_weights_after_loading(layer)
    for rows in (1, 5, 70):
        x = torch.randn(rows, 96) * 3
        got = layer(x)
        want = compressed_tensors.fp8_linear(x, layer.fp8_weight, layer.weight_scale, layer.bias, 40)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        values, x_scale = compressed_tensors.fp8_quantize_rows(x)
        assert set(values.unique().tolist()) <= set(torch.arange(256, dtype=torch.uint8).view(
            torch.float8_e4m3fn).float().tolist())
        dequantized = torch.nn.functional.linear(values * x_scale[:, None], levels * scale, layer.bias)
        torch.testing.assert_close(got, dequantized, atol=1e-4, rtol=1e-4)


def test_layers_keep_int8_weights_and_run_the_backend_kernel(w8a8_checkpoints: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from pluginfer.backends.cpu import int8_gemm

    llm = load(w8a8_checkpoints["llama"])
    layers = linear_layers(llm)
    assert layers and all(set(dict(m.named_parameters(recurse=False))) <= {"w8a8_weight", "weight_scale", "bias"}
                          and m.w8a8_weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32
                          for m in layers)
    if int8_gemm.load() is None:
        pytest.skip("native kernels: the W8A8 int8 GEMM did not build here")
    assert all(m.w8a8_ops[1] is int8_gemm.w8a8_linear for m in layers)
    prompt = random_prompts(200, [24], seed=5)[0]
    native = prefill_logits(llm, prompt)
    monkeypatch.setattr(int8_gemm, "op", lambda name: None)  # the torch references instead
    reference_llm = load(w8a8_checkpoints["llama"])
    assert all(m.w8a8_ops[1] is compressed_tensors.w8a8_linear for m in linear_layers(reference_llm))
    assert torch.equal(prefill_logits(reference_llm, prompt), native)  # the kernel is exact


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def _changed(config: dict, change: str) -> dict:
    config = copy.deepcopy(config)
    group = config["config_groups"]["group_0"]
    if change == "asymmetric":
        group["weights"]["symmetric"] = False
    elif change == "group":
        group["weights"].update(strategy="group", group_size=128)
    elif change == "static activations":
        group["input_activations"]["dynamic"] = False
    elif change == "weight only":
        group["input_activations"] = None
    elif change == "fp8":
        group["weights"]["type"] = group["input_activations"]["type"] = "float"
    elif change == "fp8 per tensor":
        group["weights"].update(type="float", strategy="tensor")
        group["input_activations"]["type"] = "float"
        config["format"] = group["format"] = "float-quantized"
    elif change == "4-bit":
        group["weights"]["num_bits"] = 4
    elif change == "per-layer targets":
        group["targets"] = ["re:.*self_attn.*"]
    elif change == "packed format":
        config["format"] = group["format"] = "pack-quantized"
    elif change == "kv cache":
        config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    elif change == "ignored layers":
        config["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    elif change == "frozen":
        config["quantization_status"] = "frozen"
    return config


@pytest.mark.parametrize(("change", "message"), [
    ("asymmetric", r"config_groups\.group_0 \(targets Linear\): compressed-tensors scheme not supported "
                   r"\(weights int8, strategy channel, asymmetric, static;"),
    ("group", r"group_0 \(targets Linear\).*weights int8, strategy group, symmetric, static, group_size 128"),
    ("static activations", r"group_0 \(targets Linear\).*input activations int8, strategy token, symmetric, static"),
    ("weight only", r"group_0 \(targets Linear\).*input activations none \(weight-only\)"),
    ("fp8", r"group_0 \(targets Linear\): format 'int-quantized' is not supported for float weights \(supported: "
            r"float-quantized\)"),
    ("fp8 per tensor", r"group_0 \(targets Linear\).*weights float8, strategy tensor"),
    ("4-bit", r"group_0 \(targets Linear\).*weights int4"),
    ("per-layer targets", r"group_0 \(targets re:\.\*self_attn\.\*\): targets must be \['Linear'\]"),
    ("packed format", r"group_0 \(targets Linear\): format 'pack-quantized' is not supported"),
    ("kv cache", r"quantization_config\.kv_cache_scheme: not supported"),
    ("ignored layers", r"quantization_config\.ignore: unquantized layers \['model\.layers\.0\.mlp\.down_proj'\]"),
    ("frozen", r"quantization_config\.quantization_status: 'frozen' is not supported"),
])
def test_unsupported_schemes_are_errors_naming_scheme_and_layers(change: str, message: str,
                                                                 w8a8_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=message):
        compressed_tensors.build(_changed(_config(w8a8_checkpoints["llama"]), change))


def test_an_unsupported_checkpoint_fails_at_load_naming_the_scheme(w8a8_checkpoints: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    path = shutil.copytree(w8a8_checkpoints["llama"], tmp_path / "asymmetric")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = _changed(config["quantization_config"], "asymmetric")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"group_0 \(targets Linear\).*asymmetric"):
        load(path)


def test_a_float_checkpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="quant method 'compressed-tensors' reads a compressed-tensors checkpoint"):
        compressed_tensors.build(None)


# the worst top-20 logprob move measured here (this sharp random model), bounded at about 3x: float8's 3-bit
# mantissa moves its levels more than int8's 8 bits do
@pytest.mark.parametrize(("checkpoints", "bound"), [("w8a8_checkpoints", 0.3), ("fp8_checkpoints", 1.0)])
def test_two_tensor_parallel_ranks_track_one(checkpoints: str, bound: float, request: pytest.FixtureRequest) -> None:
    # Weights and per-output scales split with the rows (column parallel) or keep whole rows' scales (row
    # parallel). A row-parallel rank quantizes its own slice of each activation row, as vLLM's ranks do, so its
    # levels differ a little from one rank's: the top-20 logprobs of the first token moved by 0.11 (int8) and 0.33
    # (float8) at most.
    from pluginfer import SamplingParams

    path = request.getfixturevalue(checkpoints)["qwen2"]
    prompts = random_prompts(200, [20, 33, 9, 41], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20, ignore_eos=True)
    one = load(path).generate(prompts, params)
    with LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, tensor_parallel_size=2,
             timeout_s=60.0) as llm:  # closed: the ranks' torch.distributed world must not outlive the test
        two = llm.generate(prompts, params)
    worst = 0.0
    for a, b in zip(one, two, strict=True):
        expected, got = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert len(set(expected) & set(got)) >= 15
        worst = max(worst, *(abs(expected[t] - got[t]) for t in set(expected) & set(got)))
    assert worst < bound, worst


def test_the_cuda_backend_takes_its_triton_kernels(w8a8_checkpoints: dict[str, Path]) -> None:
    pytest.importorskip("triton")
    from pluginfer.backends import cuda
    from pluginfer.collectives import single
    from pluginfer.core.protocols import BuildContext
    from pluginfer.layers.context import building
    from pluginfer.layers.linear import ReplicatedLinear

    method = compressed_tensors.build(_config(w8a8_checkpoints["llama"]))
    with building(BuildContext(backend=cuda.CudaBackend(device=torch.device("cpu")), quant=method,
                               collective=single.build(), dtype=torch.float32, max_model_len=64)):
        layer = ReplicatedLinear(64, 32)
    assert all(op.__module__ == "pluginfer.backends.triton_kernels.w8a8_linear" for op in layer.w8a8_ops)


def test_the_cuda_backend_refuses_fp8_without_a_kernel() -> None:
    from pluginfer.backends import cuda
    from pluginfer.collectives import single
    from pluginfer.core.protocols import BuildContext
    from pluginfer.layers.context import building
    from pluginfer.layers.linear import ReplicatedLinear

    context = BuildContext(backend=cuda.CudaBackend(device=torch.device("cpu")), quant=compressed_tensors.build(
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}}}),
        collective=single.build(), dtype=torch.float32, max_model_len=64)
    with pytest.raises(ValueError, match=r"backend 'cuda' has no kernel for quant format 'compressed-tensors' "
                                         r"\(op fp8_linear\)"), building(context):
        ReplicatedLinear(64, 32)
