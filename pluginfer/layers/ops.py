"""The torch references of the layers' kernel ops: norms, activations, rotary embeddings, mixture of experts and
dense linears (paged attention's are in ``attention_ops.py``).

Each function is defined as an op of the core's open table (``pluginfer.core.kernels.define_op``), the call a
plugin uses for its own ops (a quant format defines its matmul in its module, ``quant/ggml_ops.py`` for
instance): the function's name is the op's, its signature and docstring the contract, its body the oracle
every device kernel is tested against. A backend registers its implementations into its ``KernelTable`` (the
cpu backend in ``backends/cpu/ops.py``, the cuda backend its Triton kernels); ``DeviceBackend.op(name)`` hands
layers the backend's kernel, or None: the layer keeps its own torch path, which equals the reference.

Conventions shared by every op: tensors live on one device; an implementation may return None (False for the
in-place rotary ops) for inputs it does not handle, and the caller then runs its torch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pluginfer.core.kernels import define_op


# -- norms and activations --------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             offset: float) -> torch.Tensor | None:
    """``x / rms(x) * (weight + offset)`` over the last axis, in float32.

    ``residual`` given: it becomes ``x + residual`` in place and is what gets normalized (the fused
    residual add). Rounding follows ``layers.norm.RMSNorm``: a half-precision input without offset is
    normalized in float32, rounded, then multiplied by the weight in its own dtype.
    """
    if residual is not None:
        residual.add_(x)
        x = residual
    dtype = x.dtype
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    if dtype == torch.float32:
        return normed * (weight.float() + offset if offset else weight)
    if offset:
        return (normed * (weight.float() + offset)).to(dtype)
    return normed.to(dtype) * weight


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` where ``x`` is ``[..., 2n]`` = ``[gate | up]``; returns ``[..., n]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor | None:
    """``gelu(gate) * up`` (``approximate`` "none" or "tanh") where ``x`` is ``[..., 2n]`` = ``[gate | up]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


# -- rotary embeddings ------------------------------------------------------------------------------
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, neox: bool) -> None:
    if neox:
        half = rotary_dim // 2
        first, second = x[..., :half], x[..., half:rotary_dim]
    else:
        first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    x1, x2 = first.float().clone(), second.float().clone()  # float() of float32 is no copy
    cos, sin = cos[:, None, :], sin[:, None, :]
    first.copy_(x1 * cos - x2 * sin)
    second.copy_(x2 * cos + x1 * sin)


def rotary_neox(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary_dim: int) -> bool:
    """Rotate the first ``rotary_dim`` features of every head in place, the two halves as pairs (neox/llama).

    ``query`` ``[tokens, heads, head_dim]``, ``key`` ``[tokens, kv_heads, head_dim]`` (rows may be strided);
    ``cos``/``sin`` float32 ``[tokens, rotary_dim / 2]``. Features past ``rotary_dim`` are left alone
    (partial rotary). Computed in float32. Returns True (done).
    """
    _rotate(query, cos, sin, rotary_dim, True)
    _rotate(key, cos, sin, rotary_dim, True)
    return True


def rotary_interleaved(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary_dim: int) -> bool:
    """As :func:`rotary_neox`, adjacent features ``(2i, 2i + 1)`` as pairs (GPT-J, GLM)."""
    _rotate(query, cos, sin, rotary_dim, False)
    _rotate(key, cos, sin, rotary_dim, False)
    return True


# -- mixture of experts -----------------------------------------------------------------------------
def _gated(x: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def fused_moe(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str) -> torch.Tensor | None:
    """Each token's router-weighted sum over its ``top_k`` experts' gated MLPs (``layers.moe.FusedExperts``).

    ``hidden`` ``[tokens, hidden]``; ``gate_up_proj`` ``[experts, 2 * inter, hidden]`` (gate rows first) and
    ``down_proj`` ``[experts, hidden, inter]`` in ``hidden``'s dtype; ``topk_weights`` float32 and
    ``topk_ids`` ``[tokens, top_k]``; ``activation`` ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``. Rounding
    follows the layer: both projections and the activation in the model dtype, the weighting and the sum
    over ``top_k`` in float32, the result rounded to the model dtype.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    outputs = torch.empty(flat_ids.shape[0], hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
    for expert in flat_ids.unique().tolist():
        pairs = (flat_ids == expert).nonzero().flatten()
        gate_up = F.linear(hidden[pairs // top_k], gate_up_proj[expert])
        outputs[pairs] = F.linear(_gated(gate_up, activation), down_proj[expert])
    weighted = outputs.float() * topk_weights.flatten()[:, None].float()
    return weighted.view(-1, top_k, hidden.shape[-1]).sum(dim=1).to(hidden.dtype)


# -- dense weights: the layout a loaded weight is kept in, and the matmul that reads it ----------------
def dense_layout(weight: torch.Tensor, batched: bool, packed_only: bool) -> str:
    """The name of the layout the backend keeps a loaded ``[out, in]`` weight in.

    ``batched``: the engine runs several sequences per step (a backend may pack for that row count).
    ``packed_only``: the caller keeps the checkpoint's layout unless the backend packs (stacked MoE
    experts). ``"checkpoint"`` (the reference's only answer) keeps ``[out, in]`` for ``F.linear``; every
    other name is the backend's own and means something only to its :func:`dense_pack` and
    :func:`dense_linear`.
    """
    return "checkpoint"


def dense_pack(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """``weight`` ``[out, in]`` in ``layout`` (a name :func:`dense_layout` gave); it replaces the weight."""
    if layout != "checkpoint":
        raise ValueError(f"dense_pack: no layout named {layout!r} here (only 'checkpoint')")
    return weight


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str,
                 out_features: int) -> torch.Tensor:
    """``x @ W^T + bias`` over any leading dims of ``x``, for a weight :func:`dense_pack` put in ``layout``;
    ``out_features`` is W's row count (a packed weight may be padded)."""
    if layout != "checkpoint":
        raise ValueError(f"dense_linear: no layout named {layout!r} here (only 'checkpoint')")
    return F.linear(x, weight, bias)


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W^T + bias`` for a bfloat16/float16 weight ``[out, in]`` (the checkpoint's layout) and ``x
    [..., in]`` of its dtype, or float32 ``x`` (a GGUF file's F16/BF16 tensor in a float32 model): products
    exact in float32, summed in float32, the result rounded once to ``x``'s dtype. None from a kernel: rows,
    dtypes or layouts it does not take (the caller runs ``F.linear``)."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# -- defined through the same call a plugin uses -------------------------------------------------------
for _reference in (rms_norm, silu_and_mul, gelu_and_mul, rotary_neox, rotary_interleaved, fused_moe, dense_layout,
                   dense_pack, dense_linear, half_linear):
    define_op(_reference)
