"""Where two backends' forward passes first part: every module's output, step by step (a script, and its helpers).

    python -m tests.backends.first_divergence MODEL_DIR [--backends cpu cuda] [--prompt-len 24] [--steps 6]

The same greedy generation runs on each backend in turn, in this process, in float32 and eagerly
(``enforce_eager``: a graph's replay calls no module's forward, so no hook would see it), with a forward hook on
every module of the model that keeps its output (a tuple's first tensor), engine step by engine step. Then,
in the first backend's order of calls, step by step, the first module whose output differs from the other
backend's (its call of the same occurrence) by more than ``--tolerance`` of its largest magnitude is named:
everything that fed it agreed. Modules one backend calls and the other does not (a fused kernel's parts) are
listed, not compared. The
steps after the greedy tokens part are not compared (their inputs differ). The last line printed is the
report as JSON (``first``: step, call, module, shape and difference, or null when every compared output agrees).

For the cuda backend without a GPU, run it under ``cuda_interpreted.environment(interpret=True)``
(TRITON_INTERPRET=1, PLUGINFER_CUDA_ON_CPU=1); on a GPU, as is. It was written for the next GPU session: the
H100's StableLM and Gemma 2 greedy tokens left transformers' while the cpu backend's and the interpreter's
did not (docs/performance.md, "On a GPU"); this names the op where the cuda backend starts to differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.checkpoints import random_prompts

# A module's output compared by max |a - b| / max |a|: float32 on two backends differs by ~1e-6 of it.
DEFAULT_TOLERANCE = 1e-3
ENGINE = dict(dtype="float32", num_blocks=96, block_size=8, enforce_eager=True)

Calls = list[tuple[str, torch.Tensor]]  # (module name, its output on the host) in call order


def record(model_dir: Path, backend: str, prompt: list[int], steps: int,
           edit: Callable[[torch.nn.Module], None] | None = None) -> tuple[list[int], list[Calls]]:
    """The greedy tokens of ``prompt`` on ``backend`` and, per engine step, every module call's output.

    ``edit``: called with the model before the recording hooks are added (a test's way to change one
    module's output: a forward hook it registers runs before them, and what it returns is what they see)."""
    from pluginfer import LLM, SamplingParams

    llm = LLM(model=str(model_dir), backend=backend, **ENGINE)
    try:
        engine = llm.engine
        model = engine.executor.pipeline
        if edit is not None:
            edit(model)
        names = {module: name or "<model>" for name, module in model.named_modules()}
        per_step: list[Calls] = []

        def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
            tensor = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(tensor, torch.Tensor):
                per_step[-1].append((names[module], tensor.detach().float().cpu().clone()))

        handles = [module.register_forward_hook(keep) for module in names]
        try:
            engine.add_request(list(prompt), SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                               request_id="divergence")
            tokens: list[int] = []
            while engine.has_unfinished_requests():
                per_step.append([])
                for output in engine.step():
                    tokens = list(output.outputs[0].token_ids)
        finally:
            for handle in handles:
                handle.remove()
        return tokens, per_step
    finally:
        llm.close()


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |a| (inf when the shapes differ or only one side is finite)."""
    if a.shape != b.shape:
        return float("inf")
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = a[finite].abs().max().item()
    return (a[finite] - b[finite]).abs().max().item() / max(scale, 1e-12)


def first_divergence(tokens: tuple[list[int], list[int]], steps: tuple[list[Calls], list[Calls]],
                     tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """The report: both token lists, the steps compared, and the first call over ``tolerance`` (or None).

    Calls are matched by module name and occurrence (a module's k-th call in a step on one side with its k-th on
    the other): a backend whose kernel fuses what the other runs as a module (the experts' activation inside
    the cuda backend's fused MoE) calls fewer modules, and those are listed in ``only_one_side``, not compared."""
    parted = next((i for i, (a, b) in enumerate(zip(*tokens)) if a != b), min(map(len, tokens)))
    comparable = min(parted + 1, *map(len, steps))  # step i samples token i: its own inputs were still equal
    report: dict[str, Any] = {"tokens": list(tokens), "tokens_part_at": parted if parted < min(map(len, tokens))
                              else None, "steps_compared": comparable, "calls_compared": 0,
                              "only_one_side": [], "largest": None, "first": None}
    for step in range(comparable):
        theirs: dict[str, list[torch.Tensor]] = {}
        for name, output in steps[1][step]:
            theirs.setdefault(name, []).append(output)
        seen: dict[str, int] = {}
        for call, (name, a) in enumerate(steps[0][step]):
            occurrence = seen[name] = seen.get(name, -1) + 1
            if occurrence >= len(theirs.get(name, ())):
                if name not in report["only_one_side"]:
                    report["only_one_side"].append(name)
                continue
            gap = difference(a, theirs[name][occurrence])
            report["calls_compared"] += 1
            if report["largest"] is None or gap > report["largest"]["difference"]:
                report["largest"] = {"step": step, "module": name, "difference": gap}
            if gap > tolerance:
                report["first"] = {"step": step, "call": call, "module": name, "difference": gap,
                                   "shape": list(a.shape)}
                return report
        report["only_one_side"] += sorted(name for name, outputs in theirs.items()
                                          if len(outputs) > seen.get(name, -1) + 1
                                          and name not in report["only_one_side"])
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a checkpoint directory")
    parser.add_argument("--backends", nargs=2, default=["cpu", "cuda"])
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--steps", type=int, default=6, help="greedy tokens to generate (engine steps)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args(argv)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompt = random_prompts(vocab, [args.prompt_len], seed=args.seed)[0]
    runs = [record(args.model, backend, prompt, args.steps) for backend in args.backends]
    report = first_divergence((runs[0][0], runs[1][0]), (runs[0][1], runs[1][1]), args.tolerance)
    report["backends"] = args.backends
    first = report["first"]
    print(f"tokens: {args.backends[0]} {report['tokens'][0]}, {args.backends[1]} {report['tokens'][1]}")
    if first is None:
        largest = report["largest"] or {"difference": 0.0, "module": None}
        print(f"every module's output agrees within {args.tolerance:g}: {report['calls_compared']} calls over "
              f"{report['steps_compared']} steps, the largest difference {largest['difference']:.3g} "
              f"({largest['module']!r})")
    else:
        print(f"first difference: step {first['step']}, call {first['call']}, module {first['module']!r}, "
              f"{first['difference']:.3g} of its magnitude (shape {first['shape']})")
    if report["only_one_side"]:
        print(f"called on one side only (not compared): {', '.join(report['only_one_side'])}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
