"""Cases for tests/models/test_families.py: the mixture-of-experts pipelines (mixtral, qwen2-moe, qwen3-moe)."""

CASES = {
    "mixtral-8-experts-top2": ("MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "mixtral-4-experts-window-16": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                           "sliding_window": 16}),
    # norm_topk_prob off (the transformers default): the top-2 weights keep their softmax values.
    # Sizes chosen so no router tie falls within bf16 rounding on the bf16 prompt: a swapped expert is a
    # discrete jump the bf16 bound does not model (transformers' own bf16 model jumps on moe_intermediate_size 32).
    "qwen3-moe-8-experts": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                    "moe_intermediate_size": 64, "head_dim": 16}),
    # Layer 0 is dense (mlp_only_layers); every second layer is sparse (decoder_sparse_step 2): layers 1 and 3.
    "qwen3-moe-norm-topk-mixed-layers": ("Qwen3MoeForCausalLM", {
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "head_dim": 16,
        "norm_topk_prob": True, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [0],
        "tie_word_embeddings": True}),
    # A shared expert scaled by sigmoid(shared_expert_gate(x)) beside the routed ones; q/k/v biases; layer 0 dense.
    "qwen2-moe-shared-expert": ("Qwen2MoeForCausalLM", {
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96,
        "num_hidden_layers": 3, "mlp_only_layers": [0]}),
}
