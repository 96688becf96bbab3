"""Quantization's speed and size, four ways (one subcommand each):

    python benchmarks/quant_throughput.py checkpoint CHECKPOINT_DIR [--formats none int8 q8_0 q4_k gptq awq ...]
    python benchmarks/quant_throughput.py linear [--inputs 896] [--outputs 4864] [--rows 1 16 512] [--runs 7]
    python benchmarks/quant_throughput.py kv-cache [--batch 16] [--context 2048] [--dtypes float16 int8 fp8]
    python benchmarks/quant_throughput.py kv-decode --work-dir DIR [--dtype float32] [--quant q8_0] [--kv float16 int8 fp8] [--cpu-time]

- ``checkpoint``: decode tokens/s at batch 1 and 16 and bytes per linear parameter of each quant format of one
  checkpoint, against its float32 self (``gptq``/``awq``: written out by round-to-nearest, then loaded).
- ``linear``: one linear layer on the cpu backend: W8A8 (``compressed-tensors``) against W8A16 (``int8``) and
  dense bf16 / float32 weights, interleaved, medians of ``--runs``.
- ``kv-cache``: per KV cache dtype, the tokens a GiB holds and one decode step's attention over a long context.
- ``kv-decode``: per KV cache dtype in one engine run, on a random Qwen2.5-0.5B-shaped model built once in
  ``--work-dir``: a text's mean NLL (prompt logprobs of the demo corpus; a random model's NLL is near log(vocab)
  whatever the cache: it shows the cache changes the outputs little), bytes per token, batch decode tokens/s;
  ``--cpu-time``: one thread, timed by the process's CPU time (a shared machine inflates wall time, not that).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 128
BLOCK = 16
CORPUS = Path(__file__).parents[1] / "pluginfer" / "demo" / "corpus.txt"


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


def checkpoint_formats(args: argparse.Namespace) -> int:
    """Each format of one checkpoint: bytes per linear parameter, decode tokens/s at each batch."""
    from pluginfer import LLM

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



W8A8_CONFIG = {  # what llm-compressor's W8A8 scheme writes (the fields the method reads)
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                              "dynamic": True}}},
}


def build(quant: str, config: dict | None, weight: torch.Tensor, dtype: torch.dtype) -> torch.nn.Module:
    """A ``ReplicatedLinear`` built as a model's would be (the quant method through the cpu kernel table)."""
    from pluginfer.backends.cpu import backend as cpu
    from pluginfer.collectives import single
    from pluginfer.core.protocols import BuildContext
    from pluginfer.core.registry import get_registry
    from pluginfer.layers.context import building
    from pluginfer.layers.linear import ReplicatedLinear

    method = get_registry().load("quant", quant)(config)
    ctx = BuildContext(backend=cpu.build(), quant=method, collective=single.build(), dtype=dtype, max_model_len=64)
    with building(ctx):
        layer = ReplicatedLinear(weight.shape[1], weight.shape[0])
    if quant == "compressed-tensors":
        scale = weight.abs().amax(dim=1, keepdim=True) / 127.5
        layer.weight.weight_loader(layer.weight, torch.round(weight / scale).clamp(-128, 127).to(torch.int8))
        layer.weight_scale.weight_loader(layer.weight_scale, scale)
    else:
        layer.weight.weight_loader(layer.weight, weight.to(dtype))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def seconds(layer: torch.nn.Module, x: torch.Tensor) -> float:
    repeats = max(3, int(2e8 // (x.shape[0] * x.shape[1] * layer.output_size) + 1))
    with torch.inference_mode():
        layer(x)
        start = time.perf_counter()
        for _ in range(repeats):
            layer(x)
        return (time.perf_counter() - start) / repeats


def linear_layer(args: argparse.Namespace) -> int:
    """One linear layer in each weight format, at each row count: ms, and each layer's time over W8A8's."""
    weight = torch.randn(args.outputs, args.inputs) * 0.05
    layers = {  # name -> (layer, activation dtype)
        "W8A8 (compressed-tensors)": (build("compressed-tensors", W8A8_CONFIG, weight, torch.float32), torch.float32),
        "W8A16 int8, float32 x": (build("int8", None, weight, torch.float32), torch.float32),
        "W8A16 int8, bf16 x": (build("int8", None, weight, torch.bfloat16), torch.bfloat16),
        "bf16 weights": (build("none", None, weight, torch.bfloat16), torch.bfloat16),
        "float32 weights": (build("none", None, weight, torch.float32), torch.float32),
    }
    from pluginfer.backends.cpu import int8_gemm

    cpu_name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                    platform.processor())
    print(f"{args.outputs}x{args.inputs} linear, {torch.get_num_threads()} threads, {cpu_name}; "
          f"W8A8 kernel: {int8_gemm.isa()}; medians of {args.runs}")
    print("| layer | " + " | ".join(f"{rows} rows: ms (W8A8 speed-up)" for rows in args.rows) + " |")
    print("| --- |" + " --- |" * len(args.rows))
    results: dict[str, dict[int, float]] = {name: {} for name in layers}
    for rows in args.rows:
        x = torch.randn(rows, args.inputs)
        times: dict[str, list[float]] = {name: [] for name in layers}
        for _ in range(args.runs):
            for name, (layer, dtype) in layers.items():
                times[name].append(seconds(layer, x.to(dtype)))
        for name in layers:
            results[name][rows] = statistics.median(times[name])
    w8a8 = results["W8A8 (compressed-tensors)"]
    for name in layers:
        cells = [f"{results[name][rows] * 1e3:.3f} ({results[name][rows] / w8a8[rows]:.2f}x)" for rows in args.rows]
        print(f"| {name} | " + " | ".join(cells) + " |")

    return 0


def _dtype(name: str) -> torch.dtype:
    from pluginfer.engine.plan import resolve_dtype
    from pluginfer.layers.kv_quant import QUANTIZED_KV_DTYPES

    return QUANTIZED_KV_DTYPES.get(name) or resolve_dtype(name, {})


def kv_cache(args: argparse.Namespace) -> int:
    """Per KV cache dtype: bytes per token, tokens per GiB, one decode step's attention over all layers."""
    from pluginfer.backends.cpu.backend import CpuBackend
    from pluginfer.core.protocols import KVCacheSpec
    from pluginfer.testing import backend_contract

    spec = KVCacheSpec(args.layers, args.kv_heads, args.head_dim)
    backend = CpuBackend()
    per_seq = -(-args.context // BLOCK)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(args.batch)]
    batch = backend_contract.paged_batch(torch.device("cpu"), tables, [args.context] * args.batch, [1] * args.batch,
                                         BLOCK)
    batch.attention = backend.prepare(batch)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(args.batch, args.heads, args.head_dim, generator=generator)
    key = torch.randn(args.batch, args.kv_heads, args.head_dim, generator=generator)
    caches, times = {}, {name: [] for name in args.dtypes}
    for name in args.dtypes:
        layers = backend.allocate_kv_cache(spec, args.batch * per_seq, BLOCK, _dtype(name))
        history = backend_contract.paged_batch(torch.device("cpu"), tables, [args.context] * args.batch,
                                               [args.context - 1] * args.batch, BLOCK)
        values = torch.randn(history.slot_mapping.shape[0], args.kv_heads, args.head_dim, generator=generator)
        for pair in layers:  # every earlier position written, as prefill steps would have
            _fill(pair, history, values)
        caches[name] = layers
    for _ in range(args.runs):
        for name in args.dtypes:
            started = time.perf_counter()
            for pair in caches[name]:
                backend.paged_attention(query, key, key, pair, batch, args.head_dim ** -0.5)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times[args.dtypes[0]])
    print(f"batch {args.batch} x context {args.context}, {args.layers} layers, {args.heads} heads / "
          f"{args.kv_heads} KV heads x {args.head_dim}; threads {torch.get_num_threads()}")
    print("| KV cache dtype | bytes per token | tokens per GiB | decode attention ms / step (all layers) | tokens/s | vs first |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.dtypes:
        median = statistics.median(times[name])
        per_token = spec.bytes_per_token(_dtype(name))
        print(f"| {name} | {per_token} | {2**30 // per_token} | {median * 1e3:.1f} | {args.batch / median:.0f} "
              f"| {base / median:.2f}x |")

    return 0


def _fill(pair: tuple, history: object, values: torch.Tensor) -> None:
    """Every earlier position's key and value, written by the reference write."""
    from pluginfer.layers import attention_ops

    attention_ops.write_kv(values, values, pair[0], pair[1], history.slot_mapping)


def _qwen_shaped_checkpoint(out: Path) -> None:
    """A random model with Qwen2.5-0.5B's layer shapes and a 32000-token vocabulary."""
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


def kv_decode(args: argparse.Namespace) -> int:
    """The engine with each KV cache dtype, side by side: a text's mean NLL, bytes per token, batch decode tokens/s
    at a long context (tokens/s = batch * (gen - 1) / (time(gen tokens) - time(1 token)), runs alternating)."""
    from pluginfer import LLM, SamplingParams

    path = Path(args.work_dir)
    if not (path / "config.json").exists():
        _qwen_shaped_checkpoint(path)
    clock = time.perf_counter
    if args.cpu_time:
        clock = time.process_time
        torch.set_num_threads(1)
    quant = {"quant": args.quant} if args.quant else {}
    llms = {kv: LLM(model=str(path), dtype=args.dtype, kv_cache_dtype=kv, **quant, max_model_len=args.context + 256,
                    max_num_seqs=args.batch, num_blocks=args.batch * (args.context + 256) // 16 + 64, block_size=16,
                    max_num_batched_tokens=2048, threads=1 if args.cpu_time else None) for kv in args.kv}
    ids = next(iter(llms.values())).engine.tokenizer.encode(CORPUS.read_text())
    while len(ids) < max(args.nll, args.context):
        ids = ids + ids
    nll = {}
    for kv, llm in llms.items():
        text = ids[:args.nll]
        [out] = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1))
        logprobs = [entry[text[i]] for i, entry in enumerate(out.prompt_logprobs) if i > 0]
        nll[kv] = -sum(getattr(value, "logprob", value) for value in logprobs) / len(logprobs)
    # a context of its own per sequence (shifted windows of the text), as separate conversations have: a shared
    # prefix would keep one context's rows in the CPU's cache for all 16, which no longer measures reading the cache
    length = args.context - args.gen
    while len(ids) < length + 97 * args.batch:
        ids = ids + ids
    prompts = [ids[97 * s:97 * s + length] for s in range(args.batch)]

    def run(llm: LLM, tokens: int) -> float:
        started = clock()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        assert all(len(out.outputs[0].token_ids) == tokens for out in outs)
        return clock() - started

    for llm in llms.values():
        run(llm, 2)  # the prefill once (prefix caching keeps the prompts' blocks), the decode step recorded
    rates: dict[str, list[float]] = {kv: [] for kv in args.kv}
    for _ in range(args.runs):
        for kv, llm in llms.items():
            first = run(llm, 1)
            rates[kv].append(args.batch * (args.gen - 1) / (run(llm, args.gen) - first))
    base, base_nll = statistics.median(rates[args.kv[0]]), nll[args.kv[0]]
    print(f"model {args.dtype}{f' ({args.quant} weights)' if args.quant else ''}, batch {args.batch} x context {args.context}, threads {torch.get_num_threads()}, "
          f"timed by {'CPU time' if args.cpu_time else 'wall clock'}")
    print(f"| KV cache dtype | bytes per token | mean NLL ({args.nll} tokens) | vs {args.kv[0]} | decode tok/s "
          f"| vs {args.kv[0]} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kv, llm in llms.items():
        rate = statistics.median(rates[kv])
        executor = llm.engine.executor
        per_token = executor.pipeline.kv_cache_spec().bytes_per_token(executor.kv_caches[0][0].dtype)
        print(f"| {kv} | {per_token} | {nll[kv]:.4f} | {100 * (nll[kv] / base_nll - 1):+.2f}% | {rate:.1f} "
              f"| {rate / base:.2f}x |")

    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    formats = modes.add_parser("checkpoint", help="decode tokens/s and bytes per parameter of each quant format")
    formats.add_argument("checkpoint", help="a Hugging Face checkpoint directory (float weights)")
    formats.add_argument("--formats", nargs="+",
                         default=["none", "int8", "q8_0", "q4_k", "q6_k", "q4_0", "int4", "gptq", "awq"])
    formats.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    formats.add_argument("--prompt-len", type=int, default=128)
    formats.add_argument("--gen-len", type=int, default=64)
    formats.add_argument("--runs", type=int, default=3)
    linear = modes.add_parser("linear", help="one linear layer: W8A8 against W8A16 and 16/32-bit weights")
    linear.add_argument("--inputs", type=int, default=896)
    linear.add_argument("--outputs", type=int, default=4864)
    linear.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    linear.add_argument("--runs", type=int, default=7)
    cache = modes.add_parser("kv-cache", help="tokens per GiB and decode attention of each KV cache dtype "
                                              "(default: Qwen2.5-0.5B's cache shape)")
    cache.add_argument("--layers", type=int, default=24)
    cache.add_argument("--heads", type=int, default=14)
    cache.add_argument("--kv-heads", type=int, default=2)
    cache.add_argument("--head-dim", type=int, default=64)
    cache.add_argument("--batch", type=int, default=16)
    cache.add_argument("--context", type=int, default=2048)
    cache.add_argument("--runs", type=int, default=5)
    cache.add_argument("--dtypes", nargs="+", default=["float16", "int8", "fp8", "fp8_e5m2"])
    decode = modes.add_parser("kv-decode", help="the engine per KV cache dtype: NLL, bytes per token, decode tokens/s")
    decode.add_argument("--work-dir", required=True, help="where the model is built (once)")
    decode.add_argument("--dtype", default="float32", help="the model's dtype")
    decode.add_argument("--quant", help="quantize the weights at load (pluginfer's --quant: q8_0, q4_0, int8, ...)")
    decode.add_argument("--kv", nargs="+", default=["float16", "int8", "fp8"], help="KV cache dtypes, baseline first")
    decode.add_argument("--batch", type=int, default=16)
    decode.add_argument("--context", type=int, default=2048)
    decode.add_argument("--gen", type=int, default=9)
    decode.add_argument("--runs", type=int, default=2)
    decode.add_argument("--nll", type=int, default=2048, help="tokens of the text whose mean NLL is taken")
    decode.add_argument("--cpu-time", action="store_true", help="one thread, timed by the process's CPU time")
    args = parser.parse_args(argv)
    return {"checkpoint": checkpoint_formats, "linear": linear_layer, "kv-cache": kv_cache,
            "kv-decode": kv_decode}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
