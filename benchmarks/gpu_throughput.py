"""The cuda backend on a GPU: nano-vllm's offline workload, and batch-1 decode against the memory-bandwidth bound.

    python benchmarks/gpu_throughput.py nano-vllm            # 256 requests, Qwen3-0.6B shape, bf16
    python benchmarks/gpu_throughput.py decode --shape 8b    # batch-1 decode of a Llama-3-8B shape, bf16
    python benchmarks/gpu_throughput.py decode --shape qwen3-0.6b --no-eager --profile 16   # where a step goes

``nano-vllm``: nano-vllm's ``bench.py`` workload (256 requests, prompt and output lengths each uniform in
[100, 1024], random prompt ids, ``ignore_eos``) on a random-weight model of Qwen3-0.6B's shape; it prints
output tokens/s, with CUDA graphs and eager (``--enforce-eager``) side by side in one process. nano-vllm's
own README reports 1,434 tokens/s (vLLM 1,362) for this workload on an RTX 4070 Laptop: a different GPU, so
no ratio is printed against it. ``decode``: one sequence, 128 prompt tokens, 256 new tokens, medians of
three runs; the bound is a matrix-vector product's measured bandwidth over the weights' bytes.

Weights are written straight to safetensors in bf16 (no transformers model is built: an 8B one would take
minutes), with a word-level tokenizer as large as the vocabulary so every id detokenizes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from offline_throughput import timed  # the same timer (synchronizes the GPU before and after)

SHAPES = {  # name: config.json fields
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
    "8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               tie_word_embeddings=False, rope_theta=500000.0),
}


def write_checkpoint(out: Path, shape: dict) -> int:
    """config.json, a tokenizer and bf16 safetensors shards of random weights; returns the weights' bytes."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, hidden, inter = shape["vocab_size"], shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    config = dict(shape, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16",
                  bos_token_id=1, eos_token_id=2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    words = {f"w{i}": i for i in range(vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="w1", eos_token="w2", unk_token="w0").save_pretrained(out)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def random(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()

    total = 0

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        nonlocal total
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / name), metadata={"format": "pt"})

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    top = {"model.embed_tokens.weight": random(vocab, hidden), "model.norm.weight": ones(hidden)}
    if not shape["tie_word_embeddings"]:
        top["lm_head.weight"] = random(vocab, hidden)
    save(top, "model-top.safetensors")
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors = {p + "self_attn.q_proj.weight": random(heads * head_dim, hidden),
                   p + "self_attn.k_proj.weight": random(kv_heads * head_dim, hidden),
                   p + "self_attn.v_proj.weight": random(kv_heads * head_dim, hidden),
                   p + "self_attn.o_proj.weight": random(hidden, heads * head_dim),
                   p + "mlp.gate_proj.weight": random(inter, hidden), p + "mlp.up_proj.weight": random(inter, hidden),
                   p + "mlp.down_proj.weight": random(hidden, inter),
                   p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden)}
        if shape["model_type"] == "qwen3":
            tensors |= {p + "self_attn.q_norm.weight": ones(head_dim), p + "self_attn.k_norm.weight": ones(head_dim)}
        save(tensors, f"model-{layer:03d}.safetensors")
    return total


def engine(path: Path, eager: bool, **options: object):
    from pluginfer import LLM

    return LLM(model=str(path), backend="cuda", dtype="bfloat16", enforce_eager=eager, enable_prefix_caching=False,
               **options)


def nano_vllm(path: Path, args: argparse.Namespace) -> None:
    from pluginfer import SamplingParams

    rng = random.Random(0)  # nano-vllm's bench.py: seed 0, ids below 10000, lengths uniform in [100, 1024]
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(args.requests)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024)) for _ in prompts]
    output_tokens = sum(p.max_tokens for p in params)
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {output_tokens} output tokens")
    for eager in (False, True) if args.eager else (False,):
        llm = engine(path, eager, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
        llm.generate([[5] * 16], SamplingParams(max_tokens=4))  # warm-up, as nano-vllm's bench does
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == output_tokens
        label = "eager (--enforce-eager)" if eager else "CUDA graphs"
        print(f"{label:<24} {seconds:7.2f} s  {output_tokens / seconds:9.1f} output tokens/s", flush=True)
        llm.close()
        del llm
        torch.cuda.empty_cache()


def bandwidth() -> float:
    """Bytes/s of a bf16 matrix-vector product over a 1 GiB matrix (what batch-1 decode does)."""
    weight = torch.randn(16384, 32768, device="cuda").to(torch.bfloat16)
    vector = torch.randn(1, 32768, device="cuda").to(torch.bfloat16)
    times = []
    for _ in range(12):
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.nn.functional.linear(vector, weight)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return weight.numel() * 2 / statistics.median(times[2:])


def decode(path: Path, weight_bytes: int, args: argparse.Namespace) -> None:
    from pluginfer import SamplingParams

    bound = bandwidth() / weight_bytes
    print(f"weights {weight_bytes / 2**30:.2f} GiB; matrix-vector bandwidth {bound * weight_bytes / 1e9:.0f} GB/s "
          f"-> batch-1 decode bound {bound:.1f} tokens/s")
    for eager in (False, True) if args.eager else (False,):
        llm = engine(path, eager, max_model_len=1024, max_num_seqs=1)
        prompt = [[7] * 128]
        rates = []
        for _ in range(3):
            full, first = (timed(llm.generate, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                           for n in (257, 1))
            rates.append(256 / (full - first))
        rate = statistics.median(rates)
        label = "eager (--enforce-eager)" if eager else "CUDA graphs"
        print(f"{label:<24} {rate:8.1f} tokens/s  {rate / bound:6.1%} of the bound", flush=True)
        if args.profile and not eager:
            profile_generation(llm, args.profile)
        llm.close()
        del llm
        torch.cuda.empty_cache()


def profile_generation(llm, new_tokens: int, rows: int = 20) -> None:
    """torch's profiler over one sequence's ``new_tokens`` greedy tokens: the ops by host time, then the device's
    kernels by their time (where the step's time goes, and how many kernels it launches)."""
    from torch.profiler import ProfilerActivity, profile

    from pluginfer import SamplingParams

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    with profile(activities=activities) as prof:
        llm.generate([[9] * 128], SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    averages = prof.key_averages()
    print(f"profile of {new_tokens} tokens at batch 1:")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    if torch.cuda.is_available():
        print(averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["nano-vllm", "decode"])
    parser.add_argument("--shape", choices=list(SHAPES), help="default: qwen3-0.6b for nano-vllm, 8b for decode")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="skip the --enforce-eager run")
    parser.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                        help="decode: also print torch's profile of TOKENS tokens through the CUDA graphs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    shape = SHAPES[args.shape or ("qwen3-0.6b" if args.workload == "nano-vllm" else "8b")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {shape['architectures'][0]}, "
          f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        weight_bytes = write_checkpoint(Path(tmp), shape)
        print(f"checkpoint written in {time.perf_counter() - start:.1f} s", flush=True)
        if args.workload == "nano-vllm":
            nano_vllm(Path(tmp), args)
        else:
            decode(Path(tmp), weight_bytes, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
