"""first_divergence.py: two backends compared module by module, step by step.

The helper is held to what it claims on the cpu backend against itself (exact agreement; an edit to one
module's output named as the first difference, at the step it happens), then the cuda backend is compared with
the cpu backend on every engine case of test_cuda_engine: under Triton's interpreter here, compiled for the GPU
where there is one (the ``gpu`` target: where the H100's StableLM and Gemma 2 mismatches are to be bisected).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.backends.cuda_interpreted import environment
from tests.backends.first_divergence import difference, first_divergence, record
from tests.backends.test_cuda_engine import CASES, TARGETS
from tests.checkpoints import random_prompts, save_hf_model
from tests.models.test_families import BASE


def scale_output(module_name: str, factor: float, from_step: int = 0):
    """An ``edit`` for ``record``: ``module_name``'s output times ``factor`` from its ``from_step``-th call."""
    def edit(model: torch.nn.Module) -> None:
        calls = [0]

        def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor | None:
            calls[0] += 1
            return output * factor if calls[0] > from_step else None

        dict(model.named_modules())[module_name].register_forward_hook(hook)
    return edit


def test_one_backend_against_itself_agrees_exactly(tiny_llama_checkpoint):
    path, model = tiny_llama_checkpoint
    prompt = random_prompts(model.config.vocab_size, [13], seed=5)[0]
    first, second = record(path, "cpu", prompt, 4), record(path, "cpu", prompt, 4)
    report = first_divergence((first[0], second[0]), (first[1], second[1]))
    assert report["first"] is None and report["tokens_part_at"] is None
    assert report["steps_compared"] == len(first[1]) >= 4
    assert report["calls_compared"] > 10 * report["steps_compared"]  # every layer's modules, not only the model
    assert report["largest"]["difference"] == 0.0


@pytest.mark.parametrize("from_step", [0, 2])
def test_a_changed_module_is_named_at_the_step_it_changes(tiny_llama_checkpoint, from_step):
    path, model = tiny_llama_checkpoint
    prompt = random_prompts(model.config.vocab_size, [13], seed=5)[0]
    plain = record(path, "cpu", prompt, 4)
    edited = record(path, "cpu", prompt, 4, edit=scale_output("model.layers.1.mlp", 1.01, from_step))
    report = first_divergence((plain[0], edited[0]), (plain[1], edited[1]))
    first = report["first"]
    assert (first["step"], first["module"]) == (from_step, "model.layers.1.mlp"), first
    assert first["difference"] == pytest.approx(0.01, rel=1e-4)  # max |a - 1.01 a| / max |a|
    # below the tolerance, the same edit is no difference
    assert first_divergence((plain[0], edited[0]), (plain[1], edited[1]), tolerance=0.02)["first"] is None


def test_difference_is_relative_and_refuses_shape_or_nonfinite_mismatches():
    a = torch.tensor([1.0, -4.0, 2.0])
    assert difference(a, a + torch.tensor([0.0, 0.0, 0.04])) == pytest.approx(0.01)
    assert difference(a, a[:2]) == float("inf")
    assert difference(a, torch.tensor([1.0, float("nan"), 2.0])) == float("inf")
    assert difference(torch.tensor([float("inf"), 1.0]), torch.tensor([float("inf"), 1.5])) == pytest.approx(0.5)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_backend_agrees_with_cpu_module_by_module(name: str, target: str, tmp_path: Path,
                                                     tiny_tokenizer_dir: Path) -> None:
    arch, overrides, _ = CASES[name]
    save_hf_model(arch, {**BASE, **overrides}, tmp_path / name, tiny_tokenizer_dir)
    done = subprocess.run([sys.executable, "-m", "tests.backends.first_divergence", str(tmp_path / name), "--steps", "5"],
                          env=environment(interpret=target == "interpreter"), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["first"] is None, (name, report["first"], report["tokens"])
    assert report["calls_compared"] > 0 and report["tokens"][0] == report["tokens"][1]


def test_calls_are_matched_by_module_and_occurrence_and_unmatched_ones_listed():
    one, two, three = torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)
    fused = [("rope", one), ("act_fn", two), ("rope", three)]  # a side that runs act_fn as a module
    other = [("rope", one), ("rope", three)]
    report = first_divergence(([5], [5]), ([fused], [other]))
    assert report["first"] is None and report["calls_compared"] == 2 and report["only_one_side"] == ["act_fn"]
    # the second rope call is compared with the other's second, wherever it comes in the order
    report = first_divergence(([5], [5]), ([fused], [[("rope", one), ("rope", two)]]))
    assert (report["first"]["module"], report["first"]["call"]) == ("rope", 2)
    # steps after the tokens part are not compared: their inputs differ
    report = first_divergence(([5, 6, 7], [5, 8, 7]), ([other] * 3, [other, other, [("rope", two)]]))
    assert report["tokens_part_at"] == 1 and report["steps_compared"] == 2 and report["first"] is None
