"""The kernel table's torch references against the layer code paths they stand for.

Each reference op must equal what the engine computes today without any kernel: the layers' own torch
path (``RMSNorm``, ``SiluAndMul``, ``GeluAndMul``, ``RotaryEmbedding``), the cpu backend's paged
attention (torch path and native decode kernel) and the Marlin layout's own dequantize-and-multiply.
Every device kernel is then tested against these references (``tests/backends/test_triton_kernels.py``).
"""

from __future__ import annotations

import pytest
import torch

from pluginfer.backends.cpu import backend as cpu
from pluginfer.core import kernels
from pluginfer.core.kernels import KernelTable
from pluginfer.layers import attention_ops, ops
from pluginfer.layers.activation import GeluAndMul, SiluAndMul
from pluginfer.layers.context import building
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.rotary import RotaryEmbedding
from pluginfer.quant import int8
from pluginfer.quant import marlin_layout as layout
from tests.backends.paged import paged_batch
from tests.layers.conftest import backend_with, make_context

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_TOLERANCE = dict(atol=2e-2, rtol=2e-2)


def _exact_or_half(dtype: torch.dtype) -> dict:
    return dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else HALF_TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_reference_equals_layer(dtype: torch.dtype, offset: float, with_residual: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    with building(make_context(backend_with(False), dtype)):
        norm = RMSNorm(48, eps=1e-5, offset=offset)
    assert norm.kernel is None
    norm.weight.data = torch.randn(48, generator=generator).to(dtype)
    x = torch.randn(5, 48, generator=generator).to(dtype)
    residual = torch.randn(5, 48, generator=generator).to(dtype) if with_residual else None
    expected = norm(x, None if residual is None else residual.clone())
    ours_residual = None if residual is None else residual.clone()
    ours = ops.rms_norm(x, ours_residual, norm.weight, 1e-5, offset)
    if with_residual:
        expected, expected_residual = expected
        assert torch.equal(ours_residual, expected_residual)
    assert ours.dtype == expected.dtype
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reference_equals_layer(dtype: torch.dtype) -> None:
    x = torch.randn(3, 2, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    with building(make_context(backend_with(False), dtype)):
        layer = SiluAndMul()
    assert torch.equal(ops.silu_and_mul(x), layer(x))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul_reference_equals_layer(approximate: str) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ops.gelu_and_mul(x, approximate), GeluAndMul(approximate)(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
def test_rotary_reference_equals_layer(dtype: torch.dtype, neox: bool, rotary_dim: int) -> None:
    head_dim, tokens = 32, 6
    generator = torch.Generator().manual_seed(3)
    with building(make_context(backend_with(False), dtype)):
        rope = RotaryEmbedding(head_dim, rotary_dim, 64, 10000.0, is_neox_style=neox)
    assert rope.kernel is None
    batch = paged_batch(cpu.build(), [[0, 1]], [tokens + 3], [tokens], 8)
    # Strided rows, as the q/k views split from a fused QKV projection are.
    qkv = torch.randn(tokens, 4 * head_dim + 2 * head_dim, generator=generator).to(dtype)
    query = qkv[:, :4 * head_dim].view(tokens, 4, head_dim)
    key = qkv[:, 4 * head_dim:].view(tokens, 2, head_dim)
    expected_query, expected_key = rope(batch, query.clone(), key.clone())
    cos, sin = rope._tables(batch)
    op = ops.rotary_neox if neox else ops.rotary_interleaved
    assert op(query, key, cos, sin, rotary_dim) is True
    torch.testing.assert_close(query, expected_query, **_exact_or_half(dtype))
    torch.testing.assert_close(key, expected_key, **_exact_or_half(dtype))


# (seq_lens, query_lens): decode rows first, then prefill rows (a chunk over cached keys, a fresh prompt).
ATTENTION_CASES = {
    "decode": ([9, 17, 1], [1, 1, 1]),
    "prefill": ([7, 12], [7, 12]),
    "chunked-prefill-and-prefix-hit": ([20, 11], [5, 11]),
    "mixed": ([13, 6, 25, 9], [1, 1, 8, 9]),
}
BLOCK_SIZE, NUM_BLOCKS, HEADS, KV_HEADS, HEAD_DIM = 4, 32, 4, 2, 16


def _attention_case(seq_lens: list[int], query_lens: list[int], v_dim: int, kv_heads: int, dtype: torch.dtype,
                    seed: int = 0):  # a tuple of test tensors
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables, used = [], 0
    for length in seq_lens:
        count = -(-length // BLOCK_SIZE)
        tables.append(blocks[used:used + count])
        used += count
    key_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM, generator=generator).to(dtype)
    value_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, v_dim, generator=generator).to(dtype)
    tokens = sum(query_lens)
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(dtype)
    key = torch.randn(tokens, kv_heads, HEAD_DIM, generator=generator).to(dtype)
    value = torch.randn(tokens, kv_heads, v_dim, generator=generator).to(dtype)
    return tables, key_cache, value_cache, query, key, value


def _reference_attention(batch, query, key, value, key_cache, value_cache, scale, window, cap):
    """Through the table with nothing registered: every op is its reference."""
    batch.attention = attention_ops.paged_attention_metadata(batch)
    return attention_ops.paged_attention(KernelTable("reference"), query, key, value, (key_cache, value_cache), batch,
                                   scale, window, cap)


@pytest.mark.parametrize("native_kernels", [False, True], ids=["cpu-torch", "cpu-native"])
@pytest.mark.parametrize("options", [(None, None), (5, None), (None, 3.0), (6, 2.0)],
                         ids=["plain", "window", "soft-cap", "window-soft-cap"])
@pytest.mark.parametrize("shape", [(KV_HEADS, HEAD_DIM), (1, HEAD_DIM), (KV_HEADS, 8)], ids=["gqa", "mqa", "v-dim"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_reference_equals_cpu_backend(case: str, shape: tuple, options: tuple,
                                                      native_kernels: bool) -> None:
    kv_heads, v_dim = shape
    window, cap = options
    seq_lens, query_lens = ATTENTION_CASES[case]
    backend = backend_with(native_kernels)
    if native_kernels and not backend.native_kernels:
        pytest.skip("native kernels unavailable")
    tables, key_cache, value_cache, query, key, value = _attention_case(seq_lens, query_lens, v_dim, kv_heads,
                                                                        torch.float32)
    scale = HEAD_DIM ** -0.5
    batch = paged_batch(backend, tables, seq_lens, query_lens, BLOCK_SIZE)
    expected_caches = (key_cache.clone(), value_cache.clone())
    expected = backend.paged_attention(query, key, value, expected_caches, batch, scale, window, cap)
    ours = _reference_attention(batch, query, key, value, key_cache, value_cache, scale, window, cap)
    assert torch.equal(key_cache, expected_caches[0]) and torch.equal(value_cache, expected_caches[1])
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_latent_attention_reference_equals_cpu_backend(case: str) -> None:
    """MLA's cache: one KV head, the value a view of the key's last features, only keys written."""
    seq_lens, query_lens = ATTENTION_CASES[case]
    backend = backend_with(False)
    tables, key_cache, _, query, key, _ = _attention_case(seq_lens, query_lens, HEAD_DIM, 1, torch.float32, seed=4)
    latent = 12
    batch = paged_batch(backend, tables, seq_lens, query_lens, BLOCK_SIZE)
    expected_cache = key_cache.clone()
    expected = backend.paged_attention(query, key, None, (expected_cache, expected_cache[..., -latent:]), batch, 0.3)
    ours = _reference_attention(batch, query, key, None, key_cache, key_cache[..., -latent:], 0.3, None, None)
    assert torch.equal(key_cache, expected_cache)
    assert ours.shape == (sum(query_lens), HEADS, latent)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=2e-5)


def test_paged_attention_reference_bf16_close_to_cpu_backend() -> None:
    seq_lens, query_lens = ATTENTION_CASES["mixed"]
    backend = backend_with(False)
    tables, key_cache, value_cache, query, key, value = _attention_case(seq_lens, query_lens, HEAD_DIM, KV_HEADS,
                                                                        torch.bfloat16, seed=5)
    batch = paged_batch(backend, tables, seq_lens, query_lens, BLOCK_SIZE)
    expected = backend.paged_attention(query, key, value, (key_cache.clone(), value_cache.clone()), batch, 0.25)
    ours = _reference_attention(batch, query, key, value, key_cache, value_cache, 0.25, None, None)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, expected, **HALF_TOLERANCE)


@pytest.mark.parametrize("group_size,zero_points", [(128, False), (-1, False), (128, True), (-1, True)])
def test_marlin_matmul_reference_equals_layout_oracle(group_size: int, zero_points: bool) -> None:
    size_k, size_n = 256, 128
    generator = torch.Generator().manual_seed(6)
    groups = 1 if group_size == -1 else size_k // group_size
    codes = torch.randint(0, 16, (size_k, size_n), generator=generator, dtype=torch.int32)
    scales = torch.rand(groups, size_n, generator=generator) * 0.02 + 0.005
    packed, permuted = layout.pack(codes, scales, group_size)
    zeros = None
    if zero_points:
        zeros = layout.pack_zero_points(torch.randint(0, 16, (groups, size_n), generator=generator, dtype=torch.int32))
    x = torch.randn(2, 3, size_k, generator=generator)
    bias = torch.randn(size_n, generator=generator)
    ours = layout.marlin_matmul(x, packed, permuted, group_size, zeros, bias, layout.position_table(x.device))
    expected = layout.matmul_reference(x, packed, permuted, group_size, zeros, bias)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_table_falls_back_to_reference_and_checks_signatures() -> None:
    table = KernelTable("test")
    assert table.get("silu_and_mul") is ops.silu_and_mul and table.implementation("silu_and_mul") is None

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return x

    table.register("silu_and_mul", silu_and_mul)
    assert table.get("silu_and_mul") is silu_and_mul and "silu_and_mul" in table and table.names() == ["silu_and_mul"]
    with pytest.raises(TypeError, match=r"takes \(y\); the op's signature is \(x\)"):
        table.register("silu_and_mul", lambda y: y)
    table.register("softmax", silu_and_mul)  # an op whose module is not imported yet: checked when looked up
    with pytest.raises(KeyError, match="no kernel op named 'softmax'"):
        table.get("softmax")
    with pytest.raises(KeyError, match="undefined op: no kernel op named 'softmax'"):
        table.check()


def test_every_op_documents_its_contract() -> None:
    for op in kernels.OPS.values():
        assert op.doc, op.name
        assert op.parameters, op.name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
def test_fused_moe_reference_equals_the_experts_layer(dtype: torch.dtype, hidden_act: str) -> None:
    """``FusedExperts``' own torch path (the cpu backend without native kernels keeps the checkpoint layout in
    half precision; float32 packs for its matmul, the same products)."""
    from pluginfer.layers.moe import FusedExperts
    from pluginfer.layers.router import route

    generator = torch.Generator().manual_seed(7)
    with building(make_context(backend_with(False), dtype)):
        experts = FusedExperts(6, 32, 24, hidden_act)
    assert experts.kernel is None
    gate_up = (torch.randn(6, 48, 32, generator=generator) * 0.3).to(dtype)
    down = (torch.randn(6, 32, 24, generator=generator) * 0.3).to(dtype)
    experts.gate_up_proj.data.copy_(gate_up)
    experts.down_proj.data.copy_(down)
    experts.process_weights_after_loading()
    hidden = torch.randn(9, 32, generator=generator).to(dtype)
    weights, ids = route(torch.randn(9, 6, generator=generator), 2, True)
    activation = "silu" if hidden_act == "silu" else "gelu_tanh"
    expected = experts(hidden, weights, ids)
    torch.testing.assert_close(ops.fused_moe(hidden, gate_up, down, weights, ids, activation), expected,
                               **_exact_or_half(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_matmul_reference_equals_the_int8_method(dtype: torch.dtype) -> None:
    from pluginfer.layers.linear import ReplicatedLinear

    generator = torch.Generator().manual_seed(8)
    context = make_context(backend_with(False), dtype)
    context.quant = int8.build()
    with building(context):
        layer = ReplicatedLinear(64, 40, bias=True)
    layer.weight.weight_loader(layer.weight, torch.randn(40, 64, generator=generator).to(dtype))
    layer.bias.data.copy_(torch.randn(40, generator=generator).to(dtype))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(2, 5, 64, generator=generator).to(dtype)
    torch.testing.assert_close(int8.int8_matmul(x, layer.qweight, layer.weight_scale, layer.bias), layer(x),
                               **_exact_or_half(dtype))
