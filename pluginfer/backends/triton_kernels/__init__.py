"""Triton kernels of the cuda backend, one module per op of ``pluginfer.layers.ops`` / ``attention_ops`` (its
torch reference is each one's oracle). Importing a module imports triton: the backend does so when built."""

from __future__ import annotations

import os

import torch

from pluginfer.core.kernels import KernelTable


def dot_in_float32(dtype: torch.dtype) -> bool:
    """Whether attention multiplies in float32 (``input_precision="ieee"``, no tf32) rather than in ``dtype``.

    float32 caches always do. bf16 ones do under ``TRITON_INTERPRET=1`` only: Triton 3.9's interpreter returns
    garbage for ``tl.dot`` on bf16 operands (numpy has no bf16); a GPU multiplies them natively.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def register(table: KernelTable) -> None:
    """Fill ``table`` with every Triton kernel."""
    from pluginfer.backends.triton_kernels import (
        decode_attention,
        fused_moe,
        gated_activation,
        ggml_k_matmul,
        ggml_matmul,
        grouped_matmul,
        int8_matmul,
        lora_sgmv,
        marlin_matmul,
        prefill_attention,
        rms_norm,
        rotary,
        w8a8_linear,
        write_kv,
    )

    table.register("rms_norm", rms_norm.rms_norm)
    table.register("silu_and_mul", gated_activation.silu_and_mul)
    table.register("gelu_and_mul", gated_activation.gelu_and_mul)
    table.register("rotary_neox", rotary.rotary_neox)
    table.register("rotary_interleaved", rotary.rotary_interleaved)
    table.register("write_kv", write_kv.write_kv)
    table.register("paged_decode_attention", decode_attention.paged_decode_attention)
    table.register("paged_prefill_attention", prefill_attention.paged_prefill_attention)
    table.register("fused_moe", fused_moe.fused_moe)
    table.register("marlin_matmul", marlin_matmul.marlin_matmul)
    table.register("grouped_matmul", grouped_matmul.grouped_matmul)
    table.register("int8_matmul", int8_matmul.int8_matmul)
    table.register("w8a8_pack", w8a8_linear.w8a8_pack)
    table.register("w8a8_linear", w8a8_linear.w8a8_linear)
    table.register("ggml_q8_0_matmul", ggml_matmul.ggml_q8_0_matmul)
    table.register("ggml_q4_0_matmul", ggml_matmul.ggml_q4_0_matmul)
    table.register("ggml_q4_k_matmul", ggml_k_matmul.ggml_q4_k_matmul)
    table.register("ggml_q6_k_matmul", ggml_k_matmul.ggml_q6_k_matmul)
    table.register("lora_sgmv", lora_sgmv.lora_sgmv)
