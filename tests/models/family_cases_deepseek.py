"""Cases for tests/models/test_families.py: DeepSeek-V2 / V2-Lite / V3 (latent attention, grouped routers).

A case's optional fourth element prepares the transformers model before it is saved (here: V3's
``e_score_correction_bias``, which transformers initialises to zeros, gets random values so the test sees it).
"""

import torch

MLA = {"num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
       "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32, "num_hidden_layers": 3}


def randomise_correction_bias(model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.4 - 0.2)


CASES = {
    # V2: q_lora_rank set, group-limited greedy (8 experts in 4 groups, 2 groups kept), 2 shared experts,
    # layer 0 dense, routed weights scaled. moe_intermediate_size 40: with 32, one position's router held a near tie
    # (top-2 margin 3e-4 against a median 0.1) that float16 rounding flips one way or the other.
    "deepseek-v2-group-limited": ("DeepseekV2ForCausalLM", {
        **MLA, "q_lora_rank": 24, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2,
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.5, "moe_intermediate_size": 40}),
    # V2-Lite style: a plain q_proj (q_lora_rank null), greedy top-k, one shared expert. moe_intermediate_size
    # 24: with 32, transformers' own bf16 model swaps an expert on the bf16 prompt (a jump the bound ignores).
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", {
        **MLA, "q_lora_rank": None, "n_routed_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "topk_method": "greedy", "first_k_dense_replace": 1, "moe_intermediate_size": 24}),
    # V3: sigmoid noaux_tc with a random correction bias, groups ranked by their top-2 sum, normalized and
    # scaled weights, YaRN rope (mscale on the softmax scale), interleaved rope pairs. moe_intermediate_size 48:
    # with 32 or 24, transformers' own bf16 model swaps experts on the bf16 prompt.
    "deepseek-v3-yarn": ("DeepseekV3ForCausalLM", {
        **MLA, "q_lora_rank": 24, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                            "beta_fast": 32, "beta_slow": 1}}, "", randomise_correction_bias),
    # V3 with rope_interleave off (transformers then rotates the neox halves), plain q_proj, default rope,
    # one expert group (noaux_tc reduces to biased top-k).
    "deepseek-v3-halves-rope": ("DeepseekV3ForCausalLM", {
        **MLA, "q_lora_rank": None, "n_routed_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 2, "rope_interleave": False}, "", randomise_correction_bias),
}
