"""Decode throughput and resident bytes per linear-weight parameter for each in-situ quant format.

    python benchmarks/quant_throughput.py CHECKPOINT_DIR [--formats none int8 q8_0]

Loads the same fp checkpoint once per format (``LLM(..., quant=FORMAT)``), then times greedy decode
(``batch × (gen − 1) / (t(gen tokens) − t(1 token))``) at batch 1 and 16, medians of --runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def linear_bytes_per_parameter(llm) -> float:  # noqa: ANN001
    total_bytes = total_params = 0
    for module in llm.engine.executor.pipeline.modules():
        if hasattr(module, "quant_method"):
            total_bytes += sum(p.nbytes for p in module.parameters(recurse=False) if p is not getattr(module, "bias", None))
            total_bytes += sum(b.nbytes for b in module.buffers(recurse=False))
            total_params += module.input_size * module.output_size
    return total_bytes / total_params


def timed(llm, prompts: list[list[int]], new_tokens: int) -> float:  # noqa: ANN001
    from pluginfer import SamplingParams

    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    return time.perf_counter() - start


def main() -> int:
    from pluginfer import LLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--formats", nargs="+", default=["none", "int8", "q8_0"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for fmt in args.formats:
        llm = LLM(model=args.checkpoint, dtype="float32", quant=fmt, max_model_len=1024,
                  max_num_seqs=max(args.batch), enable_prefix_caching=False)
        row = {"format": fmt, "bytes/param": linear_bytes_per_parameter(llm)}
        for batch in args.batch:
            samples = []
            for _ in range(args.runs):
                prompts = torch.randint(10, 30000, (batch, args.prompt_len), generator=generator).tolist()

                full = timed(llm, prompts, args.gen_len)
                first = timed(llm, prompts, 1)
                samples.append(batch * (args.gen_len - 1) / (full - first))
            row[f"decode tok/s b{batch}"] = statistics.median(samples)
        rows.append(row)
    keys = list(rows[0])
    print("".join(f"{k:>20}" for k in keys))
    for row in rows:
        print("".join(f"{row[k]:>20}" if isinstance(row[k], str) else f"{row[k]:>20.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
