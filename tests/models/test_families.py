"""Every dense model family against transformers (the oracle): one parametrized file.

Cases live in ``family_cases_*.py`` (one module per group of families, so they can grow
independently): ``CASES = {name: (hf_architecture, config_overrides, notes)}``. Each case runs
prefill logits (fp32, atol 1e-4), greedy continuations submitted together and staggered, prompts
longer than any sliding window, and a bf16 run within a stated tolerance.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import tests.models as models_package
from pluginfer import LLM
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts, save_hf_model

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)


def _collect() -> dict[str, tuple[str, dict]]:
    cases: dict[str, tuple[str, dict]] = {}
    for module in pkgutil.iter_modules(models_package.__path__):
        if module.name.startswith("family_cases_"):
            for name, case in importlib.import_module(f"tests.models.{module.name}").CASES.items():
                assert name not in cases, f"case {name} is defined twice"
                cases[name] = case
    return cases


CASES = _collect()


@pytest.fixture(scope="module", params=sorted(CASES) or [pytest.param(None, marks=pytest.mark.skip(
    reason="no family case modules yet"))])
def family(request, tmp_path_factory, tiny_tokenizer_dir):
    arch, overrides = CASES[request.param][:2]
    out = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(arch, {**BASE, **overrides}, out, tiny_tokenizer_dir)
    if len(CASES[request.param]) > 3:  # a case may change the model's weights before it is saved
        CASES[request.param][3](model)
        model.save_pretrained(out, safe_serialization=True)
    return request.param, out, model


def test_prefill_logits_match_transformers(family):
    name, path, model = family
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8)
    for prompt in random_prompts(model.config.vocab_size, [5, 23, 60], seed=0):  # 60 > every sliding window here
        ours, theirs = prefill_logits(llm, prompt), hf_logits(model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (name, (ours - theirs).abs().max())


def test_greedy_together_and_staggered_match_transformers(family):
    name, path, model = family
    prompts = random_prompts(model.config.vocab_size, [3, 17, 40, 9], seed=1)
    expected = [hf_greedy(model, p, 24) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", num_blocks=128, block_size=8, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))] == expected, name
    engine, ids, results, step = llm.engine, {}, {}, 0
    while len(results) < len(prompts):
        if step < len(prompts) * 3 and step % 3 == 0:  # one arrival every third step
            ids[engine.add_request(prompts[step // 3], greedy(24))] = step // 3
        for output in engine.step():
            if output.finished:
                results[ids[output.request_id]] = output.outputs[0].token_ids
        step += 1
    assert [results[i] for i in range(len(prompts))] == expected, name


def test_bfloat16_stays_close_to_float32(family):
    # bf16 keeps 8 significant bits; over two random layers the logits drift by a few percent of
    # their spread. The bound: the max error is under 5% of the fp32 logits' range.
    name, path, model = family
    prompt = random_prompts(model.config.vocab_size, [30], seed=2)[0]
    reference = hf_logits(model, prompt)
    ours = prefill_logits(LLM(model=str(path), dtype="bfloat16", num_blocks=32, block_size=8), prompt)
    spread = (reference.max() - reference.min()).item()
    assert (ours.float() - reference).abs().max().item() < 0.05 * spread, name
