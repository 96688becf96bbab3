"""Offline throughput: pluginfer's LLM.generate vs transformers' generate, same random llama, one session.

    python benchmarks/offline_throughput.py                 # ~0.5B shape, fp32, 3 runs each
    python benchmarks/offline_throughput.py --layers 2      # quick smoke run
    python benchmarks/offline_throughput.py --arch mixtral --layers 8 --hidden 512 --intermediate 1408
    python benchmarks/offline_throughput.py --arch deepseek --layers 4 --hidden 512 --offload 2

Decode tokens/s = batch * (gen_len - 1) / (time(generate gen_len) - time(generate 1 token)), so the
prefill is not counted; prefill tokens/s = prompt_len / time(generate 1 token). Runs alternate
between the two engines and the median of each is reported, with the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_checkpoint(out: Path, args: argparse.Namespace) -> None:
    from transformers import (
        AutoTokenizer,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    from pluginfer.demo.tokenizer import train_tokenizer

    train_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    # Pad the small demo vocabulary so every id the model can emit detokenizes (the real path).
    tokenizer.add_tokens([f"<pad_{i}>" for i in range(args.vocab - len(tokenizer))])
    tokenizer.save_pretrained(out)
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    if args.arch == "mixtral":
        config = MixtralConfig(**common, num_local_experts=args.experts, num_experts_per_tok=args.top_k)
        MixtralForCausalLM(config).save_pretrained(out, safe_serialization=True)
    elif args.arch == "deepseek":  # V3 layout: latent attention, sigmoid grouped routing, one shared expert
        common["num_key_value_heads"] = args.heads
        config = DeepseekV3Config(**common, n_routed_experts=args.experts, num_experts_per_tok=args.top_k,
                                  moe_intermediate_size=args.intermediate // 4, n_shared_experts=1,
                                  n_group=2 if args.experts % 2 == 0 and args.experts >= 4 else 1, topk_group=1,
                                  first_k_dense_replace=1, q_lora_rank=args.hidden // 2, kv_lora_rank=128,
                                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
        DeepseekV3ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    else:
        LlamaForCausalLM(LlamaConfig(**common)).save_pretrained(out, safe_serialization=True)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class Ours:
    name = "pluginfer"

    def __init__(self, path: Path, args: argparse.Namespace, max_num_seqs: int | None = None) -> None:
        from pluginfer import LLM

        # The batching engine runs every batch size; an engine sized for one sequence (the dense
        # layout for MKL's GEMV instead of oneDNN's packed one) is timed at batch 1 beside it.
        self.max_num_seqs = max_num_seqs or max(args.batch)
        self.llm = LLM(model=str(path), dtype="float32", max_model_len=1024, max_num_seqs=self.max_num_seqs,
                       enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.prefill_len),
                       num_experts_offload_per_rank=args.offload)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        from pluginfer import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        outs = self.llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)


class Transformers:
    name = "transformers"

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        with torch.inference_mode():  # static batch: every prompt has the same length, no padding
            out = self.model.generate(torch.tensor(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] == len(prompts[0]) + new_tokens


def memory_bandwidth() -> float:
    """Bytes/s of a matrix-vector product over a 256 MiB fp32 matrix (what batch-1 decode does)."""
    weight = torch.randn(8192, 8192)
    vector = torch.randn(1, 8192)
    torch.nn.functional.linear(vector, weight)
    seconds = statistics.median(timed(lambda: torch.nn.functional.linear(vector, weight)) for _ in range(10))
    return weight.numel() * 4 / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["llama", "mixtral", "deepseek"], default="llama")
    parser.add_argument("--experts", type=int, default=8, help="mixtral/deepseek: experts per layer")
    parser.add_argument("--top-k", type=int, default=2, help="mixtral/deepseek: experts per token")
    parser.add_argument("--offload", type=int, default=0,
                        help="mixtral/deepseek: experts per layer kept in host memory (pluginfer only)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["pluginfer", "transformers"])
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(path, args)
        engines = [cls(path, args) for cls in (Ours, Transformers) if cls.name in args.engines]
        single = Ours(path, args, max_num_seqs=1) if "pluginfer" in args.engines and 1 in args.batch else None
        weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        generator = torch.Generator().manual_seed(0)

        def prompts(batch: int, length: int) -> list[list[int]]:
            return torch.randint(10, args.vocab, (batch, length), generator=generator).tolist()

        results: dict[tuple[str, str], float] = {}
        for engine in engines + [single] * (single is not None):  # warm up (allocations, first-call paths)
            engine.generate(prompts(1, 16), 2)
        for batch in args.batch:
            timed_engines = engines + [single] * (batch == 1 and single is not None)
            samples: dict[int, list[float]] = {id(e): [] for e in timed_engines}
            for _ in range(args.runs):
                batch_prompts = prompts(batch, args.prompt_len)
                for engine in timed_engines:
                    full = timed(engine.generate, batch_prompts, args.gen_len)
                    first = timed(engine.generate, batch_prompts, 1)
                    samples[id(engine)].append(batch * (args.gen_len - 1) / (full - first))
            for engine in engines:
                results[(f"decode tok/s, batch {batch}", engine.name)] = statistics.median(samples[id(engine)])
            if batch == 1 and single is not None:
                results[("  same, max_num_seqs 1", "pluginfer")] = statistics.median(samples[id(single)])
        samples = {e.name: [] for e in engines}
        for _ in range(args.runs):
            prompt = prompts(1, args.prefill_len)
            for engine in engines:
                samples[engine.name].append(args.prefill_len / timed(engine.generate, prompt, 1))
        for name, values in samples.items():
            results[(f"prefill tok/s, {args.prefill_len} tokens", name)] = statistics.median(values)

    bandwidth = memory_bandwidth()
    bound = bandwidth / weight_bytes
    names = [e.name for e in engines]
    print(f"\nmodel: {args.arch}, {args.layers} layers, hidden {args.hidden}, {weight_bytes / 2**30:.2f} GiB fp32 weights; "
          f"medians of {args.runs} runs")
    print(f"{'metric':<28}" + "".join(f"{n:>14}" for n in names) + ("        ratio" if len(names) == 2 else ""))
    for metric in dict.fromkeys(m for m, _ in results):
        values = [results.get((metric, n), results.get(("decode tok/s, batch 1", n))) for n in names]
        ratio = f"{values[0] / values[1]:>12.2f}x" if len(values) == 2 else ""
        print(f"{metric:<28}" + "".join(f"{v:>14.2f}" for v in values) + ratio)
    if args.arch != "llama":  # a MoE token reads only its experts: the all-weights bound does not apply
        return 0
    print(f"\nmatrix-vector bandwidth {bandwidth / 1e9:.2f} GB/s -> batch-1 decode bound {bound:.2f} tok/s")
    if ("decode tok/s, batch 1", "pluginfer") in results:
        print(f"pluginfer batch-1 decode reaches {results[('decode tok/s, batch 1', 'pluginfer')] / bound:.0%} "
              f"of that bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
