"""The engine's scheduling paths for every model family, against transformers' greedy continuations (the oracle):
staggered arrivals with chunked prefill and preemption by recompute in a tiny KV cache, prefix-cache hits of an
exact length, and float16 against transformers' own float16 model.

One checkpoint per family, from tests/models/test_families.py's CASES (the case with a sliding window where the
family has one, so windows are crossed by the shared prefix and the generations). test_families.py and
test_llama.py cover the single-batch and staggered-only comparisons; this file adds what a cache or scheduler bug
would break: a recomputed sequence after preemption, a prefill cut into chunks, blocks reused from the cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pluginfer import LLM
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts, save_hf_model
from tests.models.test_families import BASE, CASES

FAMILIES = {
    "llama": "llama",
    "mistral": "mistral-window-16",
    "qwen2": "qwen2-sliding-window-16",
    "qwen3": "qwen3-qk-norm-tied-headdim",
    "glm4": "glm4-partial-interleaved-rope",
    "stablelm": "stablelm-qkv-bias-qk-layernorm-parallel",
    "gemma": "gemma",
    "gemma2": "gemma2-softcap-window-12",
    "gemma3": "gemma3-local-global-window-8",
    "phi2": "phi2",
    "phi3": "phi3-window-16",
    "mixtral": "mixtral-4-experts-window-16",
    "qwen3-moe": "qwen3-moe-norm-topk-mixed-layers",
    "deepseek-v2": "deepseek-v2-group-limited",
    "deepseek-v3": "deepseek-v3-yarn",
}
BLOCK_SIZE = 4
SHARED = 20  # tokens of the shared prefix: 5 whole blocks, longer than the windows of 8 and 12
MAX_TOKENS = 16
BUDGET = 16  # max_num_batched_tokens (the config's minimum): every prompt here longer than it is chunked


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tiny_tokenizer_dir):
    case = CASES[FAMILIES[request.param]]
    out = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(case[0], {**BASE, **case[1]}, out, tiny_tokenizer_dir)
    if len(case) > 3:  # a case may change the model's weights before it is saved
        case[3](model)
        model.save_pretrained(out, safe_serialization=True)
    vocab = model.config.vocab_size
    shared = random_prompts(vocab, [SHARED], seed=2)[0]
    # Four prompts on the shared prefix (tails of 4, 14, 1 and 9 tokens) and one unrelated.
    prompts = [shared + tail for tail in random_prompts(vocab, [4, 14, 1, 9], seed=3)] + random_prompts(vocab, [6], seed=4)
    expected = [hf_greedy(model, prompt, MAX_TOKENS) for prompt in prompts]
    return request.param, out, model, prompts, expected


def test_staggered_chunked_and_preempted_greedy_match_transformers(family):
    """16 blocks of 4 tokens hold the longest sequence (34 + 16 tokens: 13 blocks) but not two of them: decodes
    preempt the newest sequences, which recompute their prompt and output. One arrival every other step; the
    16-token budget cuts the 21- to 34-token prompts into chunks."""
    name, path, _, prompts, expected = family
    assert max(map(len, prompts)) > BUDGET
    llm = LLM(model=str(path), dtype="float32", num_blocks=16, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
              enable_prefix_caching=False)
    engine = llm.engine
    ids, results, step = {}, {}, 0
    while len(results) < len(prompts):
        if step % 2 == 0 and step // 2 < len(prompts):
            ids[engine.add_request(prompts[step // 2], greedy(MAX_TOKENS))] = step // 2
        for output in engine.step():
            if output.finished:
                results[ids[output.request_id]] = output.outputs[0].token_ids
        step += 1
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for every sequence at once"
    assert [results[i] for i in range(len(prompts))] == expected, name
    assert engine.block_manager.num_free_blocks == 16


def test_prefix_cache_hits_match_transformers(family):
    """The first prompt's blocks are named; each later prompt on the same prefix reuses exactly its 5 whole
    shared blocks (20 tokens: fewer would recompute for nothing, more would read another prompt's keys) and
    still continues as transformers does. Under preemption the cached blocks also survive recomputes."""
    name, path, _, prompts, expected = family
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET)
    first = llm.generate(prompts[0], greedy(MAX_TOKENS))
    assert first[0].outputs[0].token_ids == expected[0], name
    rest = llm.generate(prompts[1:], greedy(MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in rest] == expected[1:], name
    assert [o.num_cached_tokens for o in rest] == [SHARED, SHARED, SHARED, 0], name
    # A second pass over the same prompts: every whole block of each prompt is cached now (the last token of
    # a prompt is recomputed for its logits).
    again = llm.generate(prompts, greedy(MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in again] == expected, name
    whole = [min(len(p) // BLOCK_SIZE * BLOCK_SIZE, len(p) - 1) for p in prompts]
    assert [o.num_cached_tokens for o in again] == whole, name

    small = LLM(model=str(path), dtype="float32", num_blocks=16, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET)
    engine = small.engine
    ids = {engine.add_request(p, greedy(MAX_TOKENS)): i for i, p in enumerate(prompts)}
    results = {}
    while len(results) < len(prompts):
        for output in engine.step():
            if output.finished:
                results[ids[output.request_id]] = output.outputs[0].token_ids
    assert engine.scheduler.num_preemptions > 0
    assert [results[i] for i in range(len(prompts))] == expected, name


# float16: ours against transformers' own float16 model, both made from the same float32 weights. Each rounds
# every op's result to 11 significant bits (2**-11 ~ 5e-4 relative), in different orders and with different
# fusions, so the two drift apart by a few float16 steps per layer. The bound is a fraction of the float32 logits'
# spread (max - min) over two 24- and 34-token prompts, about twice the largest error measured here on this
# machine (in each comment: ours vs transformers' float16, and transformers' float16 vs its own float32 for
# scale). An expert that flips under fp16 rounding would be a jump far past these bounds: the MoE cases' sizes
# were chosen in family_cases_moe.py / family_cases_deepseek.py so that no router tie sits within rounding.
FLOAT16_BOUND = {
    # RMSNorm, rotary, gated MLP: measured 0.19% / 0.22% (transformers fp16 vs fp32: 0.22%)
    "llama": 0.005,
    "mistral": 0.006,  # 0.27% (0.21%): the sliding window changes nothing in fp16 rounding
    "qwen2": 0.005,  # 0.14% (0.26%)
    "qwen3": 0.005,  # 0.14% (0.17%): q/k norms in float32 on both sides
    "glm4": 0.005,  # 0.13% (0.21%)
    # LayerNorm (computed in float32 by both) and a parallel residual: the smallest drift, 0.05% (0.07%)
    "stablelm": 0.0015,
    "gemma": 0.005,  # 0.10% (0.16%): embeddings scaled by sqrt(hidden) in float16 on both sides
    # Soft caps: tanh of scores and logits; the largest drift here, 0.37% (0.30%)
    "gemma2": 0.008,
    "gemma3": 0.005,  # 0.15% (0.14%)
    "phi2": 0.0015,  # 0.06% (0.07%): LayerNorm, partial rotary
    "phi3": 0.005,  # 0.17% (0.14%)
    "mixtral": 0.005,  # 0.18% (0.23%): softmax router, top-2
    "qwen3-moe": 0.005,  # 0.22% (0.31%)
    "deepseek-v2": 0.005,  # 0.23% (0.18%): latent attention, grouped router
    "deepseek-v3": 0.005,  # 0.15% (0.25%): sigmoid router with correction bias, YaRN
}


def test_float16_stays_close_to_transformers_float16(family):
    name, path, model, prompts, _ = family
    llm = LLM(model=str(path), dtype="float16", num_blocks=32, block_size=8)
    half = copy.deepcopy(model).to(torch.float16)
    for prompt in prompts[:2]:  # 24 and 34 tokens: past every window
        reference = hf_logits(model, prompt)
        theirs = hf_logits(half, prompt).float()
        ours = prefill_logits(llm, prompt).float()
        spread = (reference.max() - reference.min()).item()
        error = (ours - theirs).abs().max().item() / spread
        assert error < FLOAT16_BOUND[name], (name, error, (theirs - reference).abs().max().item() / spread)
