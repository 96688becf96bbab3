"""The worked out-of-tree quant plugin (plugins/pluginfer-example-quant): its own kernel op with a cpu kernel,
conformant to the quant kit, listed, and a tiny llama quantized at load by it equal to transformers running the
same int8 weights dequantized; sharded by the layers' loaders across tensor-parallel ranks."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pluginfer import LLM
from pluginfer.core import kernels
from pluginfer.core.registry import Registry, get_registry
from pluginfer.testing.quant_contract import check_quant_method
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts

try:
    importlib.metadata.distribution("pluginfer-example-quant")
except importlib.metadata.PackageNotFoundError:  # the README test command installs it
    pytest.skip("plugins/pluginfer-example-quant is not installed (pip install -e ./plugins/pluginfer-example-quant)",
                allow_module_level=True)

from pluginfer_example_quant.method import build, dequantize, quantize  # noqa: E402 - after the installed check
from pluginfer_example_quant.ops import example_int8_rowwise_matmul, int8_rowwise_matmul_cpu  # noqa: E402

NAME = "example-int8-rowwise"
OP = "example_int8_rowwise_matmul"


def load(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, **kwargs)


def test_the_method_passes_the_quant_conformance_kit() -> None:
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(0)) * 0.1
    qweight, scale = quantize(weight)
    # Quantized at load: the checkpoint holds the float weight, the layer computes with its int8 rounding.
    check_quant_method(build, {"weight": weight}, dequantize(qweight, scale))
    # A checkpoint this method saved: its codes and scales, found by the spec's claims.
    check_quant_method(lambda: build({"quant_method": NAME}), {"qweight": qweight, "scale": scale},
                       dequantize(qweight, scale))
    check_quant_method(build, {"weight": weight.to(torch.bfloat16)},
                       dequantize(*quantize(weight.to(torch.bfloat16))), dtype=torch.bfloat16, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_equals_the_op_reference(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    qweight, scale = quantize(torch.randn(1100, 96, generator=generator))  # more rows than one tile
    x = torch.randn(3, 5, 96, generator=generator).to(dtype)
    bias = torch.randn(1100, generator=generator).to(dtype)
    backend = get_registry().load("backend", "cpu")(None, None)
    kernel = backend.op(OP)
    assert kernel is int8_rowwise_matmul_cpu  # supplied with kernels.implement, found by the cpu backend
    assert kernels.lookup(OP).reference is example_int8_rowwise_matmul
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for b in (bias, None):
        got, want = kernel(x, qweight, scale, b), example_int8_rowwise_matmul(x, qweight, scale, b)
        assert got.dtype == dtype and got.shape == (3, 5, 1100)
        assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max()
    exact = x.double() @ dequantize(qweight, scale).double().t()  # the reference is what it says it is
    assert (want.double() - exact).abs().max() <= tolerance * exact.abs().max()


def test_the_method_is_registered_and_listed() -> None:
    registry = Registry.discover()
    info = next(p for p in registry.plugins if p.distribution == "pluginfer-example-quant")
    assert info.error is None and info.version == "0.1.0"
    assert registry.claiming("quant", {"quant_method": NAME}).name == NAME
    listing = subprocess.run([sys.executable, "-m", "pluginfer", "plugins"], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    assert f"quant {NAME}" in listing and "example-quant (pluginfer-example-quant 0.1.0)" in listing


def dequantized_hf_model(path: Path) -> torch.nn.Module:
    """The oracle: transformers' llama from ``path`` with every linear weight of its layers replaced by the
    dequantized int8 rounding this method keeps (the LM head and embeddings stay dense, as in pluginfer)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    linears = [m for name, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * model.config.num_hidden_layers
    with torch.no_grad():
        for linear in linears:
            linear.weight.copy_(dequantize(*quantize(linear.weight)))
    return model


def test_a_llama_quantized_at_load_equals_transformers_on_the_same_weights(
        tiny_llama_checkpoint: tuple[Path, object]) -> None:
    path = tiny_llama_checkpoint[0]
    oracle = dequantized_hf_model(path)
    llm = load(path, quant=NAME)
    layers = [m for m in llm.engine.executor.pipeline.modules() if hasattr(m, "quant_method")]
    assert layers and all(m.qweight.dtype == torch.int8 and "weight" not in dict(m.named_parameters(recurse=False))
                          for m in layers)
    assert all(m.example_int8_matmul is int8_rowwise_matmul_cpu for m in layers)  # the plugin's own cpu kernel
    prompts = random_prompts(oracle.config.vocab_size, [7, 19, 30], seed=3)
    for prompt in prompts:
        got, want = prefill_logits(llm, prompt), hf_logits(oracle, prompt)
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    outs = llm.generate(prompts, greedy(16))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(oracle, p, 16) for p in prompts]


def test_a_checkpoint_of_this_format_is_claimed_and_loads_the_same_codes(
        tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    source, out = tiny_llama_checkpoint[0], tmp_path / "int8-rowwise"
    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        qweight, scale = quantize(tensors.pop(name))
        tensors[name.removesuffix("weight") + "qweight"], tensors[name.removesuffix("weight") + "scale"] = qweight, scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": NAME}
    (out / "config.json").write_text(json.dumps(config))

    prompt = random_prompts(config["vocab_size"], [24], seed=5)[0]
    saved = load(out)  # quant: auto, through the spec's claims
    assert saved.engine.executor.quant.name == NAME
    assert torch.equal(prefill_logits(saved, prompt), prefill_logits(load(source, quant=NAME), prompt))


@pytest.mark.parametrize("kind", ["column", "merged", "qkv-gqa", "qkv-one-kv-head", "row"])
def test_tensor_parallel_ranks_equal_one_rank(kind: str) -> None:
    """The parameters' ``output_dim`` / ``input_dim`` let the layers' own loaders shard this format: 2 thread ranks
    hold exactly the one-rank layer's rows (a row-parallel rank its columns, every scale whole)."""
    from tests.quant.tensor_parallel_harness import assert_tensor_parallel_equals_one_rank, float_cases

    case = float_cases(256, 512, lambda w: w, seed=0)[kind]
    saved = [(suffix, tensor, shard) for name, weight, shard in case.tensors
             for suffix, tensor in (zip(("qweight", "scale"), quantize(weight), strict=True)
                                    if name == "weight" else [(name, weight)])]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread ranks share torch's intra-op pool
    try:
        assert_tensor_parallel_equals_one_rank(lambda: build({"quant_method": NAME}),
                                               dataclasses.replace(case, tensors=saved), 2)
        if kind != "row":  # quantized at load, a rank holding whole rows quantizes them as one rank does
            assert_tensor_parallel_equals_one_rank(build, case, 2)
    finally:
        torch.set_num_threads(threads)
