"""The cuda backend's registration, availability and selection on a machine without a GPU.

Its kernels and the engine on it are proven under Triton's interpreter (``test_triton_kernels.py``,
``test_cuda_engine.py``); these tests check what a user without a GPU sees.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pluginfer import LLM
from pluginfer.backends import cuda
from pluginfer.backends import plugin as backends_plugin
from pluginfer.core.registry import Registry
from pluginfer.engine.plan import _backend_name

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


@pytest.fixture
def registry() -> Registry:
    registry = Registry()
    registry.register(backends_plugin, name="builtin-backends")
    return registry


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cuda.ON_CPU, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@needs_no_gpu
def test_listed_unusable_without_a_gpu(registry: Registry) -> None:
    spec = registry.resolve("backend", "cuda")
    assert spec.priority > registry.resolve("backend", "cpu").priority
    assert registry.usable(spec) == (False, "no CUDA device")
    assert "backend cuda: NVIDIA GPUs" in registry.describe()
    assert "not usable here: no CUDA device" in registry.describe()
    assert _backend_name("auto", registry) == "cpu"


@needs_no_gpu
def test_selecting_cuda_fails_at_start_naming_the_reason(tiny_llama_checkpoint) -> None:
    with pytest.raises(RuntimeError, match="backend plugin 'cuda' cannot run here: no CUDA device"):
        LLM(model=str(tiny_llama_checkpoint[0]), backend="cuda", num_blocks=8)


def test_interpreter_mode_needs_triton_interpret(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv(cuda.ON_CPU, "1")
    usable, reason = registry.usable(registry.resolve("backend", "cuda"))
    assert not usable and reason.startswith("PLUGINFER_CUDA_ON_CPU=1 needs TRITON_INTERPRET=1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.usable(registry.resolve("backend", "cuda")) == (True, "")
    assert _backend_name("auto", registry) == "cuda"  # the highest priority among usable backends


def test_backend_on_cpu_tensors_names_its_device_and_collective() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    backend = cuda.CudaBackend(device=torch.device("cpu"))
    assert backend.device == torch.device("cpu") and backend.default_collective == "gloo"
    assert backend.op("pack_panels") is None  # the cpu backend's layout ops are not the cuda backend's
    assert backend.op("rms_norm").__module__ == "pluginfer.backends.triton_kernels.rms_norm"
    assert backend.kv_cache_budget_bytes(12345, 0.5) == 12345
    assert backend.kv_cache_budget_bytes(None, 0.5) > 0


def _build_linear(backend: object, quant_name: str, quant_config: dict | None = None) -> torch.nn.Module:
    from pluginfer.collectives import single
    from pluginfer.core.protocols import BuildContext
    from pluginfer.layers.context import building
    from pluginfer.layers.linear import ReplicatedLinear
    from pluginfer.quant import plugin as quant_plugin

    registry = Registry()
    registry.register(quant_plugin, name="builtin-quant")
    quant = registry.load("quant", quant_name)(quant_config)
    with building(BuildContext(backend=backend, quant=quant, collective=single.build(), dtype=torch.float32,
                               max_model_len=64)):
        return ReplicatedLinear(256, 128)


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize(("quant_name", "config", "kernel"), [
    ("int8", None, "int8_matmul"), ("q8_0", None, "ggml_matmul"), ("q4_0", None, "ggml_matmul"),
    ("q4_k", None, "ggml_matmul"), ("q6_k", None, "ggml_matmul"),
    ("gptq", GPTQ_CONFIG, "grouped_matmul"), ("gptq", {**GPTQ_CONFIG, "bits": 8}, "grouped_matmul"),
    ("awq", AWQ_CONFIG, "grouped_matmul"), ("marlin", GPTQ_CONFIG, "marlin_matmul")])
def test_quantized_linears_reach_the_cuda_kernels_through_the_table(quant_name: str, config: dict | None,
                                                                    kernel: str) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    layer = _build_linear(cuda.CudaBackend(device=torch.device("cpu")), quant_name, config)
    assert getattr(layer, kernel).__module__.startswith("pluginfer.backends.triton_kernels.")


@pytest.mark.parametrize("quant_name", ["int4", "q4_1", "q5_0", "q5_1"])
def test_a_quant_format_without_a_cuda_kernel_fails_at_build_naming_both(quant_name: str) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match=f"backend 'cuda' has no kernel for quant format '{quant_name}'"):
        _build_linear(cuda.CudaBackend(device=torch.device("cpu")), quant_name)


def test_the_cpu_backend_keeps_its_torch_paths_for_the_same_formats() -> None:
    from pluginfer.backends.cpu import backend as cpu

    for quant_name in ("int4", "q4_k", "int8"):
        layer = _build_linear(cpu.CpuBackend(native_kernels=False), quant_name)
        assert getattr(layer, "int8_matmul", None) is None and getattr(layer, "ggml_matmul", None) is None


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_0"])
def test_gguf_file_tensors_find_their_block_kernel_or_fail_naming_both(type_name: str) -> None:
    """A GGUF file's tensor of a type the cuda backend reads in-kernel gets that kernel; another type stops the
    load naming the tensor, the backend and the type."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from gguf import GGMLQuantizationType

    from pluginfer.formats.gguf.checkpoint import GGMLTensor
    from pluginfer.quant import ggml_quantize

    qtype = GGMLQuantizationType[type_name]
    layer = _build_linear(cuda.CudaBackend(device=torch.device("cpu")), "gguf")
    raw = ggml_quantize.quantize(torch.randn(128, 256), qtype)
    tensor = GGMLTensor(raw, qtype, torch.Size((128, 256)), "blk.0.ffn_up.weight")
    if type_name != "Q5_0":
        layer.weight.weight_loader(layer.weight, tensor)
        module = "ggml_k_matmul" if type_name.endswith("_K") else "ggml_matmul"
        assert layer.gguf_matmuls[qtype].__module__ == f"pluginfer.backends.triton_kernels.{module}"
        return
    with pytest.raises(ValueError, match=f"backend 'cuda' has no kernel for quant format 'gguf' {type_name}"):
        layer.weight.weight_loader(layer.weight, tensor)
