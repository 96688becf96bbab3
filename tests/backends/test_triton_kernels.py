"""Every Triton kernel of the cuda backend under ``TRITON_INTERPRET=1`` against its torch reference; where torch
sees a CUDA device, every case again compiled for the GPU, on CUDA tensors.

The references are the ops of ``pluginfer.layers.ops`` and ``attention_ops`` (``tests/layers/test_ops.py`` holds them
equal to the layers and to the cpu backend). Triton reads ``TRITON_INTERPRET`` once, at import, so the
kernels run in a fresh interpreter: this file executed as a script with the variable set; the tests read
the JSON it prints. The cases are in ``triton_cases.py`` (layer ops, attention, MoE, a backend step)
and ``triton_quant_cases.py`` (the quantized matmuls). Shapes are the tiny models' (heads 4, KV heads 2 or
1, head dims 16 to 48, blocks of 4 to 16 tokens); float32 cases use float32 tolerances, bf16/fp16 ones
half-precision ones.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.backends.cuda_interpreted import environment
from tests.backends.triton_cases import (
    case_align_by_expert,
    case_backend,
    case_decode,
    case_fused_moe,
    case_gated,
    case_lora_sgmv,
    case_prefill,
    case_rms_norm,
    case_rotary,
    case_write_kv,
)
from tests.backends.triton_quant_cases import (
    case_ggml,
    case_grouped,
    case_int8,
    case_marlin_via_table,
    case_w8a8,
)

CASES: dict[str, tuple] = {}
for _dtype in ("float32", "bfloat16", "float16"):
    CASES |= {
        f"rms_norm-{_dtype}": (case_rms_norm, _dtype, False, 0.0),
        f"rms_norm-residual-{_dtype}": (case_rms_norm, _dtype, True, 0.0),
        f"rms_norm-residual-offset-{_dtype}": (case_rms_norm, _dtype, True, 1.0),
        f"silu_and_mul-{_dtype}": (case_gated, _dtype, "silu"),
        f"gelu_and_mul-{_dtype}": (case_gated, _dtype, "gelu"),
        f"gelu_tanh_and_mul-{_dtype}": (case_gated, _dtype, "gelu_tanh"),
        f"rotary-neox-{_dtype}": (case_rotary, _dtype, True, 32),
        f"rotary-neox-partial-{_dtype}": (case_rotary, _dtype, True, 16),
        f"rotary-interleaved-partial-{_dtype}": (case_rotary, _dtype, False, 16),
        f"write_kv-{_dtype}": (case_write_kv, _dtype, False),
        f"decode-gqa-{_dtype}": (case_decode, _dtype, "gqa", None, None, 256),
        f"prefill-chunk-and-prefix-hit-{_dtype}": (case_prefill, _dtype, "chunk-and-prefix-hit", None, None),
        f"fused_moe-mixtral-{_dtype}": (case_fused_moe, _dtype, "mixtral", "silu"),
        f"grouped-4bit-{_dtype}": (case_grouped, _dtype, 4, False),
        f"int8-{_dtype}": (case_int8, _dtype),
        f"w8a8-{_dtype}": (case_w8a8, _dtype),
        f"ggml-q8_0-{_dtype}": (case_ggml, _dtype, "q8_0"),
        f"ggml-q4_0-{_dtype}": (case_ggml, _dtype, "q4_0"),
        f"lora_sgmv-{_dtype}": (case_lora_sgmv, _dtype),
    }
CASES |= {
    "rotary-interleaved-full-float32": (case_rotary, "float32", False, 32),
    "write_kv-latent-float32": (case_write_kv, "float32", True),
    "decode-gqa-split-16-float32": (case_decode, "float32", "gqa", None, None, 16),
    "decode-gqa-split-16-window-softcap-float32": (case_decode, "float32", "gqa", 7, 2.5, 16),
    "decode-gqa-window-float32": (case_decode, "float32", "gqa", 5, None, 256),
    "decode-gqa-softcap-float32": (case_decode, "float32", "gqa", None, 3.0, 256),
    "decode-mha-block16-split-16-float32": (case_decode, "float32", "mha-block16", None, None, 16),
    "decode-mqa-vdim-float32": (case_decode, "float32", "mqa-vdim", None, None, 256),
    "decode-latent-float32": (case_decode, "float32", "mqa-vdim", None, None, 16, True),
    "decode-gqa-split-16-window-bfloat16": (case_decode, "bfloat16", "gqa", 9, None, 16),
    "prefill-fresh-prompts-float32": (case_prefill, "float32", "fresh-prompts", None, None),
    "prefill-chunk-and-prefix-hit-window-float32": (case_prefill, "float32", "chunk-and-prefix-hit", 6, None),
    "prefill-chunk-and-prefix-hit-softcap-float32": (case_prefill, "float32", "chunk-and-prefix-hit", None, 2.0),
    "prefill-chunk-and-prefix-hit-window-softcap-bfloat16": (case_prefill, "bfloat16", "chunk-and-prefix-hit", 6,
                                                             2.0),
    "prefill-mha-vdim-float32": (case_prefill, "float32", "mha-vdim", None, None),
    "prefill-latent-float32": (case_prefill, "float32", "chunk-and-prefix-hit", None, None, True),
    "marlin-float32": (case_marlin_via_table, "float32", False),
    "backend-float32": (case_backend, "float32", False),
    "backend-latent-float32": (case_backend, "float32", True),
    "backend-bfloat16": (case_backend, "bfloat16", False),
    "marlin-zero-points-float16": (case_marlin_via_table, "float16", True),
    "fused_moe-qwen3-moe-float32": (case_fused_moe, "float32", "qwen3-moe", "silu"),
    "fused_moe-deepseek-v2-lite-float32": (case_fused_moe, "float32", "deepseek-v2-lite", "silu"),
    "fused_moe-deepseek-top3-decode-bfloat16": (case_fused_moe, "bfloat16", "deepseek-top3-decode", "silu"),
    "fused_moe-one-expert-gelu-tanh-float32": (case_fused_moe, "float32", "qwen3-moe", "gelu_tanh", True),
    "fused_moe-gelu-float16": (case_fused_moe, "float16", "deepseek-v2-lite", "gelu"),
    "fused_moe-align-by-expert": (case_align_by_expert,),
    "grouped-4bit-act-order-float32": (case_grouped, "float32", 4, True),
    "grouped-8bit-float32": (case_grouped, "float32", 8, False),
    "grouped-8bit-act-order-float16": (case_grouped, "float16", 8, True),
}
for _qtype in ("q4_k", "q6_k"):  # three super-blocks per row, an odd output count, one row and several
    CASES |= {f"ggml-{_qtype}-rows-{_rows}-{_dtype}": (case_ggml, _dtype, _qtype, _rows, 67, 768)
              for _rows in (1, 5) for _dtype in ("float32", "bfloat16")}


def run_cases(interpret: bool) -> dict:
    """Every case in one process (each start imports torch and triton anew): interpreted, or on the GPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton; the test extra has it)")
    done = subprocess.run([sys.executable, __file__], env=environment(interpret), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reports() -> dict:
    return run_cases(interpret=True)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_equals_its_reference(reports: dict, name: str) -> None:
    report = reports[name]
    assert report["error"] is None, f"{name}: {report['error']}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_every_triton_kernel_compiled_for_the_gpu_equals_its_reference() -> None:
    """The same cases compiled for the GPU: native bf16/fp16 ``tl.dot`` (the interpreter widens them to float32)
    and the compiler's own code, against the torch references on the same device."""
    reports = run_cases(interpret=False)
    assert set(reports) == set(CASES)
    failed = {name: report["error"] for name, report in reports.items() if report["error"] is not None}
    assert not failed, failed


# Ops the cuda backend leaves to the table's reference on purpose: cuBLAS reads the checkpoint's [out, in] layout.
REFERENCE_ON_CUDA = {"dense_layout", "dense_pack", "dense_linear", "half_linear"}
# The quant formats' ops it implements (defined by their modules: quant/marlin_layout.py, packing.py, int8.py,
# ggml_ops.py, compressed_tensors.py); their dequantize-to-tiles ops are the cpu backend's.
QUANT_MATMULS = {"marlin_matmul", "grouped_matmul", "int8_matmul", "ggml_q8_0_matmul", "ggml_q4_0_matmul",
                 "ggml_q4_k_matmul", "ggml_q6_k_matmul", "w8a8_pack", "w8a8_linear"}
LAYER_OPS = {"lora_sgmv"}  # defined by their layers' modules (layers/lora.py)


def test_every_op_but_none_has_a_triton_kernel() -> None:
    """The cuda backend's table covers every op of layers/ops.py and attention_ops.py but the dense layouts
    (cuBLAS), every quant format's matmul and the layers' own ops; each kernel's parameters are its op's
    (``KernelTable.check``, once the formats defined them)."""
    from pluginfer.core import kernels
    from pluginfer.layers import attention_ops, ops  # noqa: F401 - they define the layers' ops

    done = subprocess.run([sys.executable, "-c", "from pluginfer.core.kernels import KernelTable; "
                           "from pluginfer.backends import triton_kernels; t = KernelTable('cuda'); "
                           "triton_kernels.register(t); "
                           "from pluginfer.layers import attention_ops, lora, ops; "
                           "from pluginfer.quant import compressed_tensors, ggml_ops, int8, marlin_layout, packing; t.check(); "
                           "print(','.join(t.names()))"],
                          env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    core_ops = {name for name, op in kernels.OPS.items()
                if op.reference.__module__ in ("pluginfer.layers.ops", "pluginfer.layers.attention_ops")}
    assert set(done.stdout.strip().split(",")) == (core_ops - REFERENCE_ON_CUDA) | QUANT_MATMULS | LAYER_OPS


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":  # compiled for the GPU: every case's tensors on it
        assert torch.cuda.is_available(), "run with TRITON_INTERPRET=1, or where torch sees a CUDA device"
        torch.set_default_device("cuda")
    results = {}
    for case_name, (function, *arguments) in CASES.items():
        try:
            results[case_name] = function(*arguments)
        except Exception as exc:  # one broken kernel must not hide the others' results
            results[case_name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results))
