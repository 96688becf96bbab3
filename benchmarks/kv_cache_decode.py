"""KV cache dtypes side by side in one engine run: a text's mean NLL, tokens per GiB of cache, batch decode at a
long context.

    python benchmarks/kv_cache_decode.py --work-dir DIR                      # float32 model: float16 int8 fp8
    python benchmarks/kv_cache_decode.py --work-dir DIR --dtype bfloat16 --kv bfloat16 int8 fp8

The model is random with Qwen2.5-0.5B's layer shapes (24 layers, hidden 896, 14 heads on 2 KV heads x 64) and a
32000-token vocabulary, built once in DIR. NLL: prompt logprobs of the first ``--nll`` tokens of the demo corpus
(repeated). Decode: ``--batch`` prompts of ``--context - --gen`` tokens (a shared prefix, then 32 tokens each its
own), tokens/s = batch * (gen - 1) / (time(gen tokens) - time(1 token)), runs alternating between the dtypes,
median reported. A random model's NLL is near log(vocab) whatever the cache: it shows the cache changes the
outputs little, not what a trained model loses.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

CORPUS = Path(__file__).parents[1] / "pluginfer" / "demo" / "corpus.txt"


def build_checkpoint(out: Path) -> None:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from pluginfer.demo.tokenizer import train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens([f"<pad_{i}>" for i in range(32000 - len(tokenizer))])
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def main() -> None:
    from pluginfer import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--dtype", default="float32", help="the model's dtype")
    parser.add_argument("--kv", nargs="+", default=["float16", "int8", "fp8"], help="KV cache dtypes, baseline first")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--gen", type=int, default=9)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--nll", type=int, default=2048)
    args = parser.parse_args()
    path = Path(args.work_dir)
    if not (path / "config.json").exists():
        build_checkpoint(path)
    llms = {kv: LLM(model=str(path), dtype=args.dtype, kv_cache_dtype=kv, max_model_len=args.context + 256,
                    max_num_seqs=args.batch, num_blocks=args.batch * (args.context + 256) // 16 + 64, block_size=16,
                    max_num_batched_tokens=2048) for kv in args.kv}
    ids = next(iter(llms.values())).engine.tokenizer.encode(CORPUS.read_text())
    while len(ids) < max(args.nll, args.context, 1000 + 32 * args.batch):
        ids = ids + ids
    nll = {}
    for kv, llm in llms.items():
        text = ids[:args.nll]
        [out] = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1))
        logprobs = [entry[text[i]] for i, entry in enumerate(out.prompt_logprobs) if i > 0]
        nll[kv] = -sum(getattr(value, "logprob", value) for value in logprobs) / len(logprobs)
    prompts = [ids[:args.context - args.gen - 32] + ids[1000 + 32 * s:1000 + 32 * (s + 1)] for s in range(args.batch)]

    def run(llm: LLM, tokens: int) -> float:
        started = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        assert all(len(out.outputs[0].token_ids) == tokens for out in outs)
        return time.perf_counter() - started

    for llm in llms.values():
        run(llm, 2)  # the prefill once (prefix caching keeps the prompts' blocks), the decode step recorded
    rates: dict[str, list[float]] = {kv: [] for kv in args.kv}
    for _ in range(args.runs):
        for kv, llm in llms.items():
            first = run(llm, 1)
            rates[kv].append(args.batch * (args.gen - 1) / (run(llm, args.gen) - first))
    base, base_nll = statistics.median(rates[args.kv[0]]), nll[args.kv[0]]
    print(f"model {args.dtype}, batch {args.batch} x context {args.context}, threads {torch.get_num_threads()}")
    print(f"| KV cache dtype | bytes per token | mean NLL ({args.nll} tokens) | vs {args.kv[0]} | decode tok/s "
          f"| vs {args.kv[0]} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kv, llm in llms.items():
        rate = statistics.median(rates[kv])
        executor = llm.engine.executor
        per_token = executor.pipeline.kv_cache_spec().bytes_per_token(executor.kv_caches[0][0].dtype)
        print(f"| {kv} | {per_token} | {nll[kv]:.4f} | {100 * (nll[kv] / base_nll - 1):+.2f}% | {rate:.1f} "
              f"| {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
