"""Cases for tests/models/test_families.py: the gemma and phi pipelines' architectures.

Windows (8-16) are far shorter than the 60-token prompts; soft caps are small enough to bend the scores.
"""

_SLIDING, _FULL = "sliding_attention", "full_attention"

CASES = {
    # head_dim * heads (96) differs from hidden_size (64), as in Gemma-7B.
    "gemma": ("GemmaForCausalLM", {"head_dim": 24, "rms_norm_eps": 1e-6}),
    # Three layers: sliding, full, sliding (transformers' default alternation).
    "gemma2-softcap-window-12": ("Gemma2ForCausalLM", {
        "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 12, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 2.0}),
    # Local layers (default rope, base 10k) and a global one (linear-scaled rope, base 100k), window 8.
    "gemma3-local-global-window-8": ("Gemma3ForCausalLM", {
        "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 32,
        "layer_types": [_SLIDING, _FULL, _SLIDING], "final_logit_softcapping": 4.0,
        "rope_parameters": {_FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
                            _SLIDING: {"rope_type": "default", "rope_theta": 10_000.0}}}),
    # Partial rotary (8 of 16 features), LayerNorm, biases, parallel attention and MLP.
    "phi2": ("PhiForCausalLM", {"partial_rotary_factor": 0.5, "layer_norm_eps": 1e-5}),
    "phi2-qk-layernorm-rotary-0.75": ("PhiForCausalLM", {"partial_rotary_factor": 0.75, "qk_layernorm": True,
                                                           "hidden_act": "gelu_new"}),
    # Fused qkv_proj / gate_up_proj checkpoint tensors, window 16.
    "phi3-window-16": ("Phi3ForCausalLM", {"sliding_window": 16}),
    # LongRoPE's short factors and its cos/sin scale (from factor 4): every sequence here fits the original
    # 256 positions, the run's max_model_len too. The long factors: tests/models/test_phi3_longrope.py.
    "phi3-longrope-short": ("Phi3ForCausalLM", {
        "original_max_position_embeddings": 256, "partial_rotary_factor": 0.75,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10_000.0, "factor": 4.0,
                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                            "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0]}}),
}
