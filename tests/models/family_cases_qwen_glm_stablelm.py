"""Cases for tests/models/test_families.py: the qwen, glm4 and stablelm pipelines."""

CASES = {
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", {}),
    # Layers from max_window_layers on use the window: layer 0 full, layer 1 sliding.
    "qwen2-sliding-window-16": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16,
                                                    "max_window_layers": 1}),
    "qwen3-qk-norm-tied-headdim": ("Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen3-attention-bias": ("Qwen3ForCausalLM", {"head_dim": 16, "attention_bias": True,
                                                  "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 10000.0}}),
    # GLM-4: interleaved rope on half of each 32-wide head, q/k/v bias, post-attention/-MLP norms.
    "glm4-partial-interleaved-rope": ("Glm4ForCausalLM", {"head_dim": 32}),
    # StableLM: LayerNorm, neox rope on a quarter of each 16-wide head.
    "stablelm": ("StableLmForCausalLM", {}),
    "stablelm-qkv-bias-qk-layernorm-parallel": ("StableLmForCausalLM", {
        "use_qkv_bias": True, "qk_layernorm": True, "use_parallel_residual": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
}
