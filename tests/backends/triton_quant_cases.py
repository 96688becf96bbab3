"""The cases of tests/backends/test_triton_kernels.py for the quantized matmuls (Marlin, GPTQ/AWQ grouped,
int8, GGML): each runs a Triton kernel under ``TRITON_INTERPRET=1`` against its reference in
the quant formats' modules and returns a report (``error`` None when they agree).
"""

from __future__ import annotations

import os

import torch

from tests.backends.triton_cases import compare, compare_truncated, tensors


def case_marlin_via_table(dtype: str, zero_points: bool) -> dict:
    from pluginfer.backends.triton_kernels import marlin_matmul
    from pluginfer.quant import marlin_layout as layout

    randn, generator = tensors(7)
    size_k, size_n, group_size = 256, 128, 128
    codes = torch.randint(0, 16, (size_k, size_n), generator=generator, dtype=torch.int32)
    packed, scales = layout.pack(codes, torch.rand(2, size_n, generator=generator) * 0.02 + 0.005, group_size)
    zeros = layout.pack_zero_points(torch.randint(0, 16, (2, size_n), generator=generator,
                                                  dtype=torch.int32)) if zero_points else None
    x = randn(3, size_k, dtype=getattr(torch, dtype))
    arguments = (x, packed, scales.to(x.dtype), group_size, zeros, None, layout.position_table(x.device))
    return compare(marlin_matmul.marlin_matmul(*arguments), layout.marlin_matmul(*arguments), dtype)


def case_grouped(dtype: str, bits: int, act_order: bool) -> dict:
    """GPTQ's packing (and AWQ's, repacked into it): the kernel, the table's reference, and the quant
    method's own dequantization (``packing.dequantize_grouped``) times x."""
    from pluginfer.backends.triton_kernels import grouped_matmul
    from pluginfer.quant.packing import dequantize_grouped, pack_int32
    from pluginfer.quant.packing import grouped_matmul as grouped_reference

    randn, generator = tensors(10)
    size_k, size_n, group_size = 128, 96, 32
    groups, levels = size_k // group_size, 1 << bits
    codes = torch.randint(0, levels, (size_k, size_n), generator=generator, dtype=torch.int32)
    zeros = torch.randint(0, levels, (groups, size_n), generator=generator, dtype=torch.int32)
    scales = (torch.rand(groups, size_n, generator=generator) * 0.02 + 0.005).half()
    g_idx = (torch.randperm(size_k, generator=generator) // group_size).int() if act_order else None
    x = randn(3, size_k, dtype=getattr(torch, dtype))
    arguments = (x, pack_int32(codes, bits, dim=0), pack_int32(zeros, bits, dim=1), scales, g_idx, bits, group_size,
                 randn(size_n, dtype=x.dtype))
    expected = grouped_reference(*arguments)
    groups_of = g_idx if g_idx is not None else torch.arange(size_k) // group_size
    dense = dequantize_grouped(codes, zeros, scales, groups_of, x.dtype)
    layer_path = (x.float() @ dense.float().t()).to(x.dtype) + arguments[-1]
    ours = grouped_matmul.grouped_matmul(*arguments)
    report = compare_truncated(ours, expected, 1e-2) if dtype == "bfloat16" else compare(ours, expected, dtype)
    if report["error"] is None and not torch.equal(expected, layer_path):
        report["error"] = "the reference differs from dequantize_grouped"
    return report


def case_int8(dtype: str) -> dict:
    from pluginfer.backends.triton_kernels import int8_matmul
    from pluginfer.quant.int8 import int8_matmul as int8_reference
    from pluginfer.quant.int8 import quantize_int8

    randn, _ = tensors(11)
    q, scale = quantize_int8(randn(80, 96))
    x = randn(2, 3, 96, dtype=getattr(torch, dtype))
    arguments = (x, q, scale, randn(80, dtype=x.dtype))
    ours, expected = int8_matmul.int8_matmul(*arguments), int8_reference(*arguments)
    return compare_truncated(ours, expected, 1e-2) if dtype == "bfloat16" else compare(ours, expected, dtype)


def case_w8a8(dtype: str) -> dict:
    """Activations quantized per row (one at the -128 level) and int8 tiles summed in int32: float32 under the
    interpreter exactly the reference's result (the float epilogue is its operations in its order; a GPU may
    contract the bias add into an FMA, an ulp apart)."""
    from pluginfer.backends.triton_kernels import w8a8_linear
    from pluginfer.quant import compressed_tensors

    randn, generator = tensors(12)
    qweight = torch.randint(-128, 128, (80, 300), dtype=torch.int8, generator=generator)
    x = randn(2, 3, 300, dtype=getattr(torch, dtype))
    x[0, 0, 0] = -2 * x[0, 0].abs().max()
    scale = torch.rand(80, generator=generator) * 0.01
    arguments = (x, w8a8_linear.w8a8_pack(qweight), scale, randn(80, dtype=x.dtype), 80)
    ours = w8a8_linear.w8a8_linear(*arguments)
    expected = compressed_tensors.w8a8_linear(x, qweight, *arguments[2:])
    if dtype == "float32":
        return compare(ours, expected, "exact" if os.environ.get("TRITON_INTERPRET") == "1" else "float32")
    return compare_truncated(ours, expected, 1e-2) if dtype == "bfloat16" else compare(ours, expected, dtype)


def case_ggml(dtype: str, qtype_name: str, rows: int = 5, outputs: int = 72, cols: int = 128) -> dict:
    """Q8_0 / Q4_0 / Q4_K / Q6_K bytes from the quant methods' quantizer: the kernel, the table's reference,
    and ``ggml_blocks.dequantize`` (the GGUF method's torch path) times x."""
    from gguf import GGMLQuantizationType

    from pluginfer.backends.triton_kernels import ggml_k_matmul, ggml_matmul
    from pluginfer.quant import ggml_blocks, ggml_ops, ggml_quantize

    randn, _ = tensors(12)
    qtype = GGMLQuantizationType[qtype_name.upper()]
    raw = ggml_quantize.quantize(randn(outputs, cols), qtype)
    x = randn(rows, cols, dtype=getattr(torch, dtype))
    name = f"ggml_{qtype_name}_matmul"
    expected = getattr(ggml_ops, name)(x, raw, cols, None)
    ours = getattr(ggml_k_matmul if qtype_name.endswith("_k") else ggml_matmul, name)(x, raw, cols, None)
    report = compare_truncated(ours, expected, 1e-2) if dtype == "bfloat16" else compare(ours, expected, dtype)
    layer_path = (x.float() @ ggml_blocks.dequantize(raw, qtype, cols, x.dtype).float().t()).to(x.dtype)
    if report["error"] is None and not torch.equal(expected, layer_path):
        report["error"] = "the reference differs from ggml_blocks.dequantize"
    return report
