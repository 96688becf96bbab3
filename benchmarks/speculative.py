"""Speculative decoding's batch-1 decode speed against plain decoding, same model, one session.

    python benchmarks/speculative.py                       # ~0.5B shape, float32, k = 4, acceptance 1.0 0.8 0.6 0
    python benchmarks/speculative.py --layers 2 --runs 1   # quick smoke run
    python benchmarks/speculative.py --workload code-edit --work-dir DIR   # prompt lookup on a trained model
    python benchmarks/speculative.py --workload chat --work-dir DIR        # a draft model on a trained model

``--workload code-edit`` and ``chat`` run a model that has learned something: a small llama trained here on the
standard library (``trained_llama.py``: renaming a name in a function; answering with a docstring), widened
to the 0.5B shape without changing its function, so a step costs what a 0.5B model's does and the drafts are taken
as a trained model takes them. ``code-edit``: prompt lookup (``method: ngram``) against plain decoding on held-out
functions; ``chat``: a smaller llama distilled from the small model (its greedy answers) as the draft model. Both greedy, float32, the outputs
compared token for token; tokens/s over each answer (until its end token or ``--gen-len``), summed over the prompts.

A random model repeats nothing, so the prompt-lookup proposer would draft nothing it accepts. This tool
instead drafts the model's own greedy continuation (found by a plain run first), each draft token replaced
by a wrong one with probability 1 - ``--acceptance``: it measures what a step that checks ``k`` drafts costs
and what speculation gains at a given acceptance rate, on the engine's real path (scheduling, the
multi-token pass, verification). What acceptance the ngram proposer reaches depends on the model and the
text (a trained model editing code repeats most of its prompt); that needs a trained checkpoint.
"same tokens": how many of the output's first tokens equal plain decoding's (in bfloat16 the multi-token pass
rounds differently from a decode step, and a near-tie can go the other way; in float32 they are the same).
Decode tokens/s = (gen_len - 1) / (time(gen_len tokens) - time(1 token)); medians of ``--runs`` runs,
the engines interleaved. ``--cpu-time``: one thread, timed by the process's CPU time (a shared machine).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from offline_throughput import build_checkpoint

from pluginfer import LLM, SamplingParams
from pluginfer.speculative.ngram import NgramProposer

clock = time.perf_counter  # time.process_time under --cpu-time


def decode_rate(llm: LLM, prompt: list[int], gen_len: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    start = clock()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = clock() - start
    start = clock()
    tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
    return (gen_len - 1) / (clock() - start - first), tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[1.0, 0.8, 0.6, 0.0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, help="keep the checkpoint here (default: a temp dir)")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by the process's CPU time")
    parser.add_argument("--workload", choices=["synthetic", "code-edit", "chat"], default="synthetic",
                        help="synthetic: a random model, drafts of a set acceptance; code-edit / chat: a trained model")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts of a trained workload")
    parser.add_argument("--train-steps", type=int, default=1500, help="training steps of each small model")
    parser.add_argument("--copy-steps", type=int, default=1000,
                        help="steps of copying random tokens before them (the 2-layer model: trained_llama.py)")
    args = parser.parse_args()
    if args.cpu_time:
        global clock
        clock = time.process_time
        torch.set_num_threads(1)
    args.arch = "llama"
    if args.workload != "synthetic":
        return trained_workload(args)

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pluginfer-spec-"))
    if not (work / "config.json").exists():
        build_checkpoint(work, args)
    prompt = random.Random(0).choices(range(1000, args.vocab), k=args.prompt_len)
    common = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=1, enable_prefix_caching=False,
                  threads=1 if args.cpu_time else None)
    plain = LLM(str(work), **common)
    _, continuation = decode_rate(plain, prompt, args.gen_len)  # warm-up, and the drafts to come

    acceptance = {"rate": 1.0}
    rng = random.Random(1)

    def oracle(self: NgramProposer, requests: list) -> list[list[int]]:
        drafts = []
        for request in requests:
            done = len(request.token_ids) - len(prompt)
            drafts.append([token if rng.random() < acceptance["rate"] else (token + 1) % args.vocab
                           for token in continuation[done:done + request.max_tokens]])
        return drafts

    NgramProposer.propose = oracle
    spec = LLM(str(work), **common, speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
    rows = []
    for rate in args.acceptance:
        acceptance["rate"] = rate
        ours, theirs, accepted, same = [], [], [], []
        for _ in range(args.runs):
            theirs.append(decode_rate(plain, prompt, args.gen_len)[0])
            before = spec.engine.stats()
            speed, tokens = decode_rate(spec, prompt, args.gen_len)
            after = spec.engine.stats()
            # the multi-token pass rounds differently from a decode step: in 16-bit a near-tie may flip
            same.append(next((i for i, (a, b) in enumerate(zip(tokens, continuation)) if a != b), len(tokens)))
            ours.append(speed)
            drafted = after.spec_draft_tokens - before.spec_draft_tokens
            accepted.append((after.spec_accepted_tokens - before.spec_accepted_tokens) / max(1, drafted))
        rows.append((rate, statistics.median(accepted), statistics.median(theirs), statistics.median(ours), min(same)))
    print(f"batch-1 decode, {args.layers} layers, hidden {args.hidden}, {args.dtype}, prompt {args.prompt_len}, "
          f"{args.gen_len} tokens, k = {args.k}, medians of {args.runs}, "
          f"{'one thread, CPU time' if args.cpu_time else 'wall clock'}")
    print(f"{'draft acceptance':>16} {'measured':>9} {'plain tok/s':>12} {'speculative tok/s':>18} {'ratio':>6} "
          f"{'same tokens':>12}")
    for rate, measured, theirs, ours, same in rows:
        print(f"{rate:>16.2f} {measured:>9.2f} {theirs:>12.1f} {ours:>18.1f} {ours / theirs:>5.2f}x "
              f"{same:>5d} of {args.gen_len}")
    return 0


def answer_rate(llm: LLM, prompts: list[list[int]], gen_len: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s over every prompt's answer (greedy, to its end token or ``gen_len``), and the answers."""
    first = SamplingParams(temperature=0.0, max_tokens=1)
    params = SamplingParams(temperature=0.0, max_tokens=gen_len)
    decoding, tokens, answers = 0.0, 0, []
    for prompt in prompts:
        start = clock()
        llm.generate(prompt, first)
        prefill = clock() - start
        start = clock()
        answer = llm.generate(prompt, params)[0].outputs[0].token_ids
        decoding += clock() - start - prefill
        tokens += len(answer) - 1
        answers.append(list(answer))
    return tokens / decoding, answers


def trained_workload(args: argparse.Namespace) -> int:
    """Prompt lookup (code-edit) or a draft model (chat) against plain decoding, on the trained, widened llama."""
    import trained_llama
    from transformers import AutoTokenizer

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pluginfer-spec-"))
    shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 intermediate=args.intermediate)
    wide, draft, texts = trained_llama.build(work, args.workload, shape, args.train_steps, copy_steps=args.copy_steps)
    tokenizer = AutoTokenizer.from_pretrained(str(wide))
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts[:args.prompts]]
    common = dict(dtype="float32", max_model_len=2048, max_num_seqs=1, enable_prefix_caching=False,
                  threads=1 if args.cpu_time else None)
    if args.workload == "code-edit":
        speculative = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    else:
        speculative = {"model": str(draft), "num_speculative_tokens": args.k}
    plain = LLM(str(wide), **common)
    spec = LLM(str(wide), **common, speculative_config=speculative)
    answer_rate(plain, prompts[:1], 8)  # warm-up
    answer_rate(spec, prompts[:1], 8)
    theirs, ours, accepted, same = [], [], [], True
    for _ in range(args.runs):
        rate, expected = answer_rate(plain, prompts, args.gen_len)
        theirs.append(rate)
        before = spec.engine.stats()
        rate, answers = answer_rate(spec, prompts, args.gen_len)
        after = spec.engine.stats()
        ours.append(rate)
        same = same and answers == expected
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        accepted.append((after.spec_accepted_tokens - before.spec_accepted_tokens) / max(1, drafted))
    tokens = sum(len(answer) for answer in expected)
    print(f"{args.workload}: {speculative}; the trained llama widened to {args.layers} layers, hidden {args.hidden} "
          f"(float32); {len(prompts)} held-out prompts, {tokens} answer tokens; medians of {args.runs}; "
          f"{'one thread, CPU time' if args.cpu_time else 'wall clock'}")
    print(f"{'plain tok/s':>12} {'speculative tok/s':>18} {'ratio':>6} {'drafts taken':>13} {'same output':>12}")
    print(f"{statistics.median(theirs):>12.1f} {statistics.median(ours):>18.1f} "
          f"{statistics.median(ours) / statistics.median(theirs):>5.2f}x {statistics.median(accepted):>13.2f} "
          f"{'yes' if same else 'NO':>12}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
