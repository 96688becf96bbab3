"""LoRA serving cost: 16 sequences spread over 4 adapters against the same 16 on the base model, one session.

    python benchmarks/lora_throughput.py                  # random llama, hidden 512, 8 layers; rank 16 adapters
    python benchmarks/lora_throughput.py --layers 2 --runs 1   # quick smoke run
    python benchmarks/lora_throughput.py --cpu-time            # one thread, CPU time (a shared machine)
    python benchmarks/lora_throughput.py --experts 8           # a Qwen3-MoE; adapters on the routed experts too

The adapters (peft, random non-zero weights) adapt every projection (``--experts``: a Qwen3-MoE of that many
experts, top 2, whose adapters take the attention projections and the routed experts' fused tensors). Three engines' figures, interleaved, medians
of ``--runs`` runs: the base model without ``--enable-lora`` (decode steps replayed), the base model through a
LoRA engine (eager steps, no adapter), and the 16 sequences through 4 adapters in one batch. Tokens/s counts the
generated tokens over the whole ``generate`` (prefill included); ``--cpu-time``: one thread, timed by the process's
CPU time, so that other jobs on a shared machine do not enter the figure.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build(out: Path, args: argparse.Namespace) -> int:
    """A random llama (or Qwen3-MoE) and 4 adapters under ``out``; the vocabulary size."""
    import peft
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from pluginfer.demo.tokenizer import train_tokenizer

    train_tokenizer(out / "base")
    tokenizer = AutoTokenizer.from_pretrained(str(out / "base"))
    shape = dict(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                 num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                 max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    if args.experts:
        base = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_experts=args.experts, num_experts_per_tok=2,
                                                  moe_intermediate_size=args.hidden * 3 // 4, norm_topk_prob=True,
                                                  head_dim=args.hidden // 8))
        targets = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                   "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    else:
        base = LlamaForCausalLM(LlamaConfig(**shape))
        targets = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    base.save_pretrained(out / "base", safe_serialization=True)
    for i in range(4):
        lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, init_lora_weights=False, **targets)
        peft.get_peft_model(copy.deepcopy(base), lora).save_pretrained(str(out / f"adapter{i}"))
    return len(tokenizer)


def main() -> None:
    from pluginfer import LLM, LoRARequest, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE of this many experts (0: a llama)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by the process's CPU time")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
    threads = dict(threads=1) if args.cpu_time else {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        vocab = build(root, args)
        generator = torch.Generator().manual_seed(1)
        prompts = torch.randint(10, vocab, (16, args.prompt_len), generator=generator).tolist()
        params = SamplingParams(temperature=0, max_tokens=args.gen_len, ignore_eos=True)
        plain = LLM(str(root / "base"), **threads)
        lora = LLM(str(root / "base"), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **threads)
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(root / f"adapter{i}")) for i in range(4)]
        runs = {"base, engine without --enable-lora": (plain, None),
                "base, LoRA engine": (lora, None),
                "4 adapters x 4 sequences": (lora, [adapters[i % 4] for i in range(16)])}
        for llm, loras in runs.values():  # warm-up
            llm.generate(prompts, params, lora_request=loras)
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.runs):
            for name, (llm, loras) in runs.items():
                started = clock()
                outputs = llm.generate(prompts, params, lora_request=loras)
                seconds = clock() - started
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
        print(f"{f'Qwen3-MoE, {args.experts} experts, ' if args.experts else ''}hidden {args.hidden}, {args.layers} layers, rank {args.rank}, prompt {args.prompt_len}, "
              f"{args.gen_len} tokens; {'one thread, CPU time' if args.cpu_time else 'wall clock'}")
        for name, values in rates.items():
            print(f"{name:36s} {statistics.median(values):8.1f} tokens/s  (runs: "
                  f"{', '.join(f'{v:.0f}' for v in values)})")
        plain.close()
        lora.close()


if __name__ == "__main__":
    main()
