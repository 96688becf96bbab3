"""M-RoPE (layers/mrope.py) against transformers' Qwen2-VL rotary and its apply_multimodal_rotary_pos_emb."""

from __future__ import annotations

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.layers.context import building
from pluginfer.layers.mrope import MROPE_POSITIONS, MRotaryEmbedding
from tests.layers.conftest import backend_with, make_context

HEAD_DIM, SECTION = 16, [2, 3, 3]


def test_rotation_matches_transformers() -> None:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    config = Qwen2VLConfig(text_config=dict(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTION})).text_config
    positions = torch.stack([torch.arange(10), torch.arange(10) // 3, torch.arange(10) % 4]) + 5
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(10, 4, HEAD_DIM, generator=generator), torch.randn(10, 2, HEAD_DIM, generator=generator)
    cos, sin = Qwen2VLRotaryEmbedding(config)(q, positions[:, None, :])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    with building(make_context(backend_with(False))):
        rope = MRotaryEmbedding(HEAD_DIM, 64, 10000.0, SECTION)
    batch = ForwardBatch(*(torch.zeros(1, dtype=torch.long),) * 7, query_lens=[10], max_query_len=10,
                         max_seq_len=10, block_size=16)
    batch.positions = positions[0]
    batch.extras[MROPE_POSITIONS] = positions
    got_q, got_k = rope(batch, q.clone(), k.clone())
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
