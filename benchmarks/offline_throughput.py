"""Offline throughput: pluginfer's LLM.generate vs transformers' generate, same random llama, one session.

    python benchmarks/offline_throughput.py                 # ~0.5B shape, fp32, 3 runs each
    python benchmarks/offline_throughput.py --layers 2      # quick smoke run
    python benchmarks/offline_throughput.py --arch mixtral --layers 8 --hidden 512 --intermediate 1408
    python benchmarks/offline_throughput.py --arch deepseek --layers 4 --hidden 512 --offload 2
    python benchmarks/offline_throughput.py --device cuda --dtype bfloat16 --batch 1 32 128 \
        --engines pluginfer pluginfer-eager transformers   # on a GPU: the cuda backend, graphs and eager
    python benchmarks/offline_throughput.py --batch 1 2 4 8 16 --plot offline.png   # tokens/s against batch

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


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn, *args) -> float:
    synchronize()
    start = time.perf_counter()
    fn(*args)
    synchronize()
    return time.perf_counter() - start


class Ours:
    name = "pluginfer"

    def __init__(self, path: Path, args: argparse.Namespace, max_num_seqs: int | None = None,
                 eager: bool = False) -> None:
        from pluginfer import LLM

        # The batching engine runs every batch size; on the CPU an engine sized for one sequence (the dense
        # layout for MKL's GEMV instead of oneDNN's packed one) is timed at batch 1 beside it.
        self.name = "pluginfer-eager" if eager else "pluginfer"
        self.max_num_seqs = max_num_seqs or max(args.batch)
        backend = {"backend": "cuda", "enforce_eager": eager} if args.device == "cuda" else {}
        self.llm = LLM(model=str(path), dtype=args.dtype, max_model_len=1024, max_num_seqs=self.max_num_seqs,
                       enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.prefill_len),
                       num_experts_offload_per_rank=args.offload, **backend)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        from pluginfer import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        outs = self.llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)


class Transformers:
    name = "transformers"

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(args.device)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype))
        self.model = self.model.to(self.device).eval()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        with torch.inference_mode():  # static batch: every prompt has the same length, no padding
            out = self.model.generate(torch.tensor(prompts, device=self.device), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] == len(prompts[0]) + new_tokens


def memory_bandwidth(device: str, dtype: torch.dtype) -> float:
    """Bytes/s of a matrix-vector product over a 256 MiB fp32 (1 GiB on a GPU) matrix: what batch-1 decode does."""
    size = 16384 if device == "cuda" else 8192
    weight = torch.randn(size, size, device=device).to(dtype)
    vector = torch.randn(1, size, device=device).to(dtype)
    torch.nn.functional.linear(vector, weight)
    seconds = statistics.median(timed(lambda: torch.nn.functional.linear(vector, weight)) for _ in range(10))
    return weight.numel() * weight.element_size() / seconds


def plot(path: Path, rates: dict[str, dict[int, float]], title: str) -> None:
    """Decode tokens/s against batch size, one line per engine (``rates[engine][batch]``), as a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for engine, by_batch in rates.items():
        batches = sorted(by_batch)
        ax.plot(batches, [by_batch[b] for b in batches], marker="o",
                linestyle="-" if engine.startswith("pluginfer") else "--", label=engine)
    ax.set_xscale("log", base=2)
    ticks = sorted({b for by_batch in rates.values() for b in by_batch})
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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
    parser.add_argument("--engines", nargs="+", default=["pluginfer", "transformers"],
                        choices=["pluginfer", "pluginfer-eager", "transformers"],
                        help="pluginfer-eager: the cuda backend without CUDA graphs (--device cuda)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: pluginfer's cuda backend and transformers on the GPU")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write a PNG of decode tokens/s against batch size, one line per engine (matplotlib)")
    args = parser.parse_args()
    if args.plot is not None:
        import matplotlib  # noqa: F401 - fail before the runs, not after them

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(path, args)
        makers = {"pluginfer": lambda: Ours(path, args), "pluginfer-eager": lambda: Ours(path, args, eager=True),
                  "transformers": lambda: Transformers(path, args)}
        engines = [make() for name, make in makers.items() if name in args.engines]
        single = (Ours(path, args, max_num_seqs=1) if "pluginfer" in args.engines and 1 in args.batch
                  and args.device == "cpu" else None)
        # The checkpoint is float32; the engines hold it in --dtype.
        weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors")) * getattr(torch, args.dtype).itemsize // 4
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

    bandwidth = memory_bandwidth(args.device, getattr(torch, args.dtype))
    bound = bandwidth / weight_bytes
    names = [e.name for e in engines]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nmodel: {args.arch}, {args.layers} layers, hidden {args.hidden}, {weight_bytes / 2**30:.2f} GiB "
          f"{args.dtype} weights on {device}; medians of {args.runs} runs")
    # Ratios: each pluginfer engine against the last engine named (transformers, by default).
    ratios = names[:-1] if len(names) > 1 else []
    print(f"{'metric':<28}" + "".join(f"{n:>16}" for n in names) + "".join(f"{n[:12] + ' ratio':>20}" for n in ratios))
    for metric in dict.fromkeys(m for m, _ in results):
        values = [results.get((metric, n), results.get(("decode tok/s, batch 1", n))) for n in names]
        print(f"{metric:<28}" + "".join(f"{v:>16.2f}" for v in values)
              + "".join(f"{v / values[-1]:>19.2f}x" for v in values[:-1]))
    if args.plot is not None:
        rates = {name: {batch: results[(f"decode tok/s, batch {batch}", name)] for batch in args.batch} for name in names}
        plot(args.plot, rates, f"{args.arch} {args.layers} layers, hidden {args.hidden}, {args.dtype} on {device}; "
                               f"{torch.get_num_threads()} threads; medians of {args.runs}")
        print(f"plot written to {args.plot}")
    if args.arch != "llama":  # a MoE token reads only its experts: the all-weights bound does not apply
        return 0
    print(f"\nmatrix-vector bandwidth {bandwidth / 1e9:.2f} GB/s -> batch-1 decode bound {bound:.2f} tok/s")
    if ("decode tok/s, batch 1", "pluginfer") in results:
        print(f"pluginfer batch-1 decode reaches {results[('decode tok/s, batch 1', 'pluginfer')] / bound:.0%} "
              f"of that bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
