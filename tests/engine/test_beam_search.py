"""Beam search equals transformers' ``generate(num_beams=...)``: the same beams, in order, with their scores."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pluginfer import LLM
from pluginfer.engine.beam_search import BeamSearch, BeamSearchParams, run_beam_search
from tests.checkpoints import hf_beams, padded

PROMPTS = [[11, 12, 13, 14, 15], [300, 7, 42]]


def hf_scorer(model, candidates: int):
    """A ``generate`` stand-in: the top next-token logprobs of each sequence, from transformers' own forward."""
    def generate(prompts: list[list[int]], _params: object, lora_request: object = None) -> list[object]:
        outputs = []
        for prompt in prompts:
            with torch.inference_mode():
                logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
            top = logprobs.topk(candidates)
            entry = dict(zip(top.indices.tolist(), top.values.tolist()))
            outputs.append(type("Out", (), {"outputs": [type("Choice", (), {"logprobs": [entry]})]}))
        return outputs
    return generate


@pytest.fixture(scope="module")
def frequent_token(tiny_llama_checkpoint) -> int:
    """A token the tiny model often predicts: as "EOS", beams finish early and the stopping rules matter."""
    model = tiny_llama_checkpoint[1]
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return Counter(out[0, len(PROMPTS[0]):].tolist()).most_common(1)[0][0]


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"), [
    (2, 1.0, False), (3, 1.0, True), (3, 2.0, "never"), (4, 0.0, False), (4, -1.0, "never"), (5, 0.5, True),
])
def test_the_search_equals_transformers_on_its_own_logprobs(tiny_llama_checkpoint, frequent_token, width,
                                                            length_penalty, early_stopping):
    model = tiny_llama_checkpoint[1]
    params = BeamSearchParams(width, max_tokens=10, length_penalty=length_penalty, early_stopping=early_stopping)
    candidates = BeamSearch(PROMPTS[0], params, {frequent_token}).candidates
    ours = run_beam_search(hf_scorer(model, candidates), PROMPTS, params, {frequent_token}, 256)
    for prompt, beams in zip(PROMPTS, ours):
        expected, scores = hf_beams(model, prompt, params, frequent_token)
        length = len(expected[0])
        assert [padded(beam.token_ids, length, frequent_token) for beam in beams] == expected
        # the sums of logprobs agree to 1e-4 (transformers' whole-prompt forward against its cached one: float32
        # rounding, which the CPU's GEMM kernel changes); a score is its sum times length ** -length_penalty
        assert [beam.score for beam in beams] == pytest.approx(scores, abs=1e-4 * max(1.0, 10 ** -length_penalty))
        assert all(beam.finished for beam in beams)
    if length_penalty <= 1.0:  # (a penalty above 1 favours the long beams: the short ones lose)
        assert any(beam.token_ids[-1] == frequent_token and len(beam.token_ids) < 10 for beams in ours
                   for beam in beams), "no beam ended early: the stopping rules were not exercised"


def test_llm_beam_search_equals_transformers(tiny_llama_checkpoint):
    model = tiny_llama_checkpoint[1]
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    with LLM(model=str(tiny_llama_checkpoint[0]), dtype="float32", num_blocks=128, block_size=8) as llm:
        results = llm.beam_search(PROMPTS, params)
        eos = model.generation_config.eos_token_id
        for prompt, beams in zip(PROMPTS, results):
            expected, scores = hf_beams(model, prompt, params, eos)
            assert [padded(beam.token_ids, len(expected[0]), eos) for beam in beams] == expected
            assert [beam.score for beam in beams] == pytest.approx(scores, abs=1e-4)
            assert beams[0].text == llm.get_tokenizer().decode(beams[0].token_ids, skip_special_tokens=True)
        assert not llm.engine.has_unfinished_requests()


def test_parameters_out_of_reach_are_refused():
    with pytest.raises(ValueError, match="beam_width: at most 10"):
        BeamSearch([1], BeamSearchParams(beam_width=11, max_tokens=2), {2})
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="over the context"):
        run_beam_search(None, [[1] * 250], BeamSearchParams(beam_width=2, max_tokens=10), {2}, 256)
