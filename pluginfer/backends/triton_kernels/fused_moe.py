"""Mixture-of-experts experts as two grouped GEMMs (op ``fused_moe``), vLLM's fused-MoE design.

The (token, expert) pairs are sorted by expert, each run padded to ``BLOCK_M`` in torch with shapes bounded on
the host (no synchronisation). A program takes ``BLOCK_M`` pairs of one expert and ``BLOCK_N`` outputs: it
gathers their rows, multiplies by the expert's weight and scatters back. One launch for gate/up, the gated
activation kernel, one launch for down (times the router weight, in float32), then one torch sum over
``top_k``. Reference: ``layers.ops.fused_moe``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pluginfer.backends.triton_kernels import dot_in_float32
from pluginfer.backends.triton_kernels.gated_activation import ACTIVATIONS, gated

BLOCK_M = 16


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
    num_pairs, N, K,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    A_ROWS_PER_PAIR_DIV: tl.constexpr, ROUTER_WEIGHTS: tl.constexpr, WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs  # padding rows (blocks past the last run hold nothing else)
    a_rows = (pairs // A_ROWS_PER_PAIR_DIV).to(tl.int64)  # the gate/up input is the pair's token
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if WIDEN:
            # float32 operands (and bf16 under the interpreter, whose bf16 tl.dot is wrong): no tf32
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    result = acc.to(a_ptr.dtype.element_ty)  # each projection is rounded to the model dtype, as in torch
    if ROUTER_WEIGHTS:
        router = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
        result = result.to(tl.float32) * router[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on,
             result.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pairs, block experts): pair indices ``t * top_k + k`` grouped by expert, each expert's run
    padded with ``pairs`` (the sentinel) to a multiple of ``block_m``, and the expert of every block of
    ``block_m`` (the last expert for blocks past the last run: they hold only the sentinel). Shapes depend on
    host integers only."""
    flat = topk_ids.flatten().long()
    pairs = flat.shape[0]
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank_in_run = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    destination = (padded_end - padded)[sorted_experts] + rank_in_run
    capacity = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[destination] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32)


def _grouped_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                  block_experts: torch.Tensor, pairs: int, rows_per_pair_div: int,
                  router_weights: torch.Tensor | None) -> None:
    num_experts, size_n, size_k = weight.shape
    block_n = 64 if size_n >= 64 else 32
    block_k = 64 if size_k >= 64 else 32
    grid = (block_experts.shape[0], triton.cdiv(size_n, block_n))
    _grouped_gemm_kernel[grid](
        a, weight, out, sorted_pairs, block_experts, router_weights if router_weights is not None else out,
        pairs, size_n, size_k,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out.stride(1),
        A_ROWS_PER_PAIR_DIV=rows_per_pair_div, ROUTER_WEIGHTS=router_weights is not None,
        WIDEN=dot_in_float32(a.dtype), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_moe(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str) -> torch.Tensor | None:
    if activation not in ACTIVATIONS or hidden.dim() != 2 or not (hidden.dtype == gate_up_proj.dtype
                                                                  == down_proj.dtype):
        return None
    tokens, top_k = topk_ids.shape
    num_experts, double_inter, _ = gate_up_proj.shape
    pairs = tokens * top_k
    if pairs == 0:
        return hidden.new_zeros(hidden.shape)
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts, BLOCK_M)
    gate_up = torch.empty(pairs, double_inter, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, gate_up_proj, gate_up, sorted_pairs, block_experts, pairs, top_k, None)
    inter = gated(gate_up, ACTIVATIONS[activation])
    down = torch.empty(pairs, down_proj.shape[1], dtype=torch.float32, device=hidden.device)
    _grouped_gemm(inter, down_proj, down, sorted_pairs, block_experts, pairs, 1,
                  topk_weights.reshape(-1).float().contiguous())
    return down.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)
