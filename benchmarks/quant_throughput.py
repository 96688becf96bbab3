"""Decode throughput and resident bytes per linear-weight parameter for each quant format.

    python benchmarks/quant_throughput.py CHECKPOINT_DIR [--formats none int8 q8_0 q4_k gptq awq ...]

In-situ formats load the same fp checkpoint once each (``LLM(..., quant=FORMAT)``). ``gptq`` and
``awq`` first write that checkpoint out as a 4-bit, group-128 GPTQ (sym, format v1) or AWQ (GEMM,
zero point) checkpoint by round-to-nearest (``write_packed``: the layouts of GPTQModel's output;
calibration changes the values, not the bytes or the speed), then load it with quant auto. Greedy
decode is timed as ``batch × (gen − 1) / (t(gen tokens) − t(1 token))`` at batch 1 and 16, medians
of --runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 128


def write_packed(checkpoint: Path, out: Path, method: str) -> None:
    """``checkpoint``'s linear weights as a 4-bit group-128 ``gptq`` or ``awq`` checkpoint in ``out``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pluginfer.quant.packing import AWQ_ORDER, pack_int32

    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                weight = handle.get_tensor(name)
                if not (name.endswith(".weight") and name.split(".")[-2] in LINEAR_NAMES):
                    tensors[name] = weight
                    continue
                prefix = name[: -len(".weight")]
                groups = weight.float().t().reshape(-1, GROUP, weight.shape[0])  # [groups, 128, out]
                if method == "gptq":  # symmetric: zero point 8, format v1 stores zero - 1
                    scales = (2 * groups.abs().amax(dim=1) / 15).clamp(min=1e-8)
                    zeros = torch.full_like(scales, 8, dtype=torch.int32)
                else:  # asymmetric with zero point
                    low, high = groups.amin(dim=1), groups.amax(dim=1)
                    scales = ((high - low) / 15).clamp(min=1e-8)
                    zeros = torch.round(-low / scales).clamp(0, 15).to(torch.int32)
                codes = torch.round(groups / scales[:, None] + zeros[:, None]).clamp(0, 15).to(torch.int32)
                codes = codes.reshape(-1, weight.shape[0])  # [in, out]
                tensors[f"{prefix}.scales"] = scales.half()
                if method == "gptq":
                    tensors[f"{prefix}.qweight"] = pack_int32(codes, 4, dim=0)
                    tensors[f"{prefix}.qzeros"] = pack_int32(zeros - 1, 4, dim=1)
                    tensors[f"{prefix}.g_idx"] = torch.arange(codes.shape[0], dtype=torch.int32) // GROUP
                else:
                    tensors[f"{prefix}.qweight"] = pack_int32(codes, 4, dim=1, order=AWQ_ORDER)
                    tensors[f"{prefix}.qzeros"] = pack_int32(zeros, 4, dim=1, order=AWQ_ORDER)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    for file in checkpoint.iterdir():
        if file.suffix != ".safetensors" and file.is_file() and file.name != "model.safetensors.index.json":
            shutil.copy(file, out / file.name)
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
         "checkpoint_format": "gptq"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def linear_bytes_per_parameter(llm) -> float:
    total_bytes = total_params = 0
    for module in llm.engine.executor.pipeline.modules():
        if hasattr(module, "quant_method"):
            total_bytes += sum(p.nbytes for p in module.parameters(recurse=False) if p is not getattr(module, "bias", None))
            total_bytes += sum(b.nbytes for b in module.buffers(recurse=False))
            total_params += module.input_size * module.output_size
    return total_bytes / total_params


def timed(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from pluginfer import SamplingParams

    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    return time.perf_counter() - start


def main() -> int:
    from pluginfer import LLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--formats", nargs="+",
                        default=["none", "int8", "q8_0", "q4_k", "q6_k", "q4_0", "int4", "gptq", "awq"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="quant-bench-"))
    for fmt in args.formats:
        model, quant = args.checkpoint, fmt
        if fmt in ("gptq", "awq"):
            model, quant = str(scratch / fmt), "auto"
            write_packed(Path(args.checkpoint), Path(model), fmt)
        start = time.perf_counter()
        llm = LLM(model=model, dtype="float32", quant=quant, max_model_len=1024,
                  max_num_seqs=max(args.batch), enable_prefix_caching=False)
        print(f"{fmt}: loaded in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
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
        del llm
    shutil.rmtree(scratch, ignore_errors=True)
    keys = list(rows[0])
    print("".join(f"{k:>20}" for k in keys))
    for row in rows:
        print("".join(f"{row[k]:>20}" if isinstance(row[k], str) else f"{row[k]:>20.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
