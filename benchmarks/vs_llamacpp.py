"""pluginfer against llama.cpp on the same GGUF files, side by side in one run, same threads.

    pip install llama-cpp-python            # the `bench` extra; builds llama.cpp from source (~15 min, 2 cores)
    python benchmarks/vs_llamacpp.py                                   # 0.5B-shaped llama, F16 Q8_0 Q4_K_M Q4_0
    python benchmarks/vs_llamacpp.py --layers 2 --formats q4_0 --runs 1  # quick smoke run
    python benchmarks/vs_llamacpp.py --cpu-time                         # a shared machine: one thread, CPU time
    python benchmarks/vs_llamacpp.py --formats q4_k_m --batch-sizes 1 2 4 8 16 32 --plot vs_llamacpp.png

On CPUs with AMX, llama.cpp 0.3.36's AMX repacking crashed in this sandbox (SIGSEGV on Q8_0/Q4_0
files; F16 ran): build it without AMX, keeping AVX-512, for the comparison (docs/performance.md has
the command). A random llama (our offline tokenizer, padded vocabulary) is built locally and written as GGUF files
by `pluginfer convert` (F16, Q8_0, Q4_0; embedding and head Q8_0 for Q8_0, F16 otherwise), and
Q4_K_M by llama.cpp's own quantizer from the F16 file. Each engine reads the very same file.

Measured per file, runs interleaved between the engines, medians reported with the ratio ours / theirs:
- batch-1 decode tokens/s: prompt 128, then 128 greedy tokens (prefill time excluded: both engines time
  only the decode steps after each sequence's first token);
- batch-16 decode tokens/s: 16 sequences of the same shape decoded together (llama.cpp through its
  batch API, one `llama_decode` per step for all 16 sequences); `--batch-sizes` sets the batches (1 and 16
  by default; batch 1 decodes 128 tokens, larger batches 32 each);
- prefill tokens/s: one 512-token prompt.
Also the file's weight bytes (what a batch-1 token reads) and the memory-bandwidth bound they imply, and for the F16
file the bound of float32 multiply-adds (its linears run float32 activations against the 16-bit weights): the
linears' FLOPs per token against torch's float32 GEMM rate here.

Our engine keeps a GGUF file's default KV cache, float16 as llama.cpp's (``auto``; the activations stay float32);
``--kv-cache-dtypes auto float32`` adds it with a float32 cache to the interleaved runs.

``--cpu-time`` runs both engines on one thread and times each phase by the process's CPU time instead of
the wall clock: on a machine shared with other work, a thread that waits for a core inflates wall-clock
time (and a second thread waits at every barrier), while the CPU time of one thread is the work done.

``--no-amx`` times what a CPU without AMX gets (AMD Zen 4, most cloud CPUs) on one with it: our engine with
``PLUGINFER_AMX=0`` against a llama.cpp built without AMX (its build is checked).

``--avx2`` times what a CPU with AVX2 but no AVX-512 gets, on one with AVX-512: the tool runs itself again with
``PLUGINFER_CPU_ISA=avx2 PLUGINFER_AMX=0 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``
(our kernels, oneDNN, torch's own and MKL's GEMM all on AVX2), against a llama.cpp built with AVX2 and without AVX-512 (checked; put its build first on
``PYTHONPATH``; docs/performance.md has the command). ``--avx2-vnni`` is the same with AVX-VNNI, as an Intel CPU
from Alder Lake on without AVX-512 (``PLUGINFER_CPU_ISA=avx2-vnni``, oneDNN on ``AVX2_VNNI``), against a llama.cpp
built with AVX2 and AVX-VNNI, without AVX-512 (checked).

``--plot FILE.png`` draws decode tokens/s against batch size, ours and llama.cpp's, one colour per file
(needs matplotlib).

``--nll N`` also compares accuracy on each file: N tokens of the demo corpus (tokenized by the file's tokenizer)
in one prefill, both engines with float32 KV caches; printed: both mean NLLs, the largest logit difference, the
logits' spread and how often both pick the same top-1 token. With random weights the logits are nearly flat and
NLL sits near log(vocab) for both; the logit difference and top-1 agreement are the sharper comparison.
``--runs 0 --nll N`` compares accuracy only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import build_checkpoint, memory_bandwidth  # noqa: E402

FORMATS = {"f16": "f16", "q8_0": "q8_0", "q4_k_m": None, "q4_0": "q4_0"}
clock = time.perf_counter  # time.process_time under --cpu-time


def write_files(model_dir: Path, out: Path, formats: list[str]) -> dict[str, Path]:
    """The GGUF files of ``formats`` in ``out``, each written once (to a temporary name, then renamed: a file
    another run has mapped is never rewritten, and an interrupted write leaves no file to be reused)."""
    files = {}
    for name in formats:
        convert = FORMATS[name] or "f16"
        path = out / f"model-{convert}.gguf"
        if not path.exists():
            embedding = "q8_0" if convert == "q8_0" else "f16"
            partial = path.with_name(f"{path.stem}.partial-{os.getpid()}.gguf")
            subprocess.run([sys.executable, "-m", "pluginfer", "convert", "--model", str(model_dir), "--quant", convert,
                            "--embedding-type", embedding, "--output", str(partial)], check=True)
            partial.replace(path)
        files[name] = path
    if "q4_k_m" in formats:
        import llama_cpp

        target = out / "model-q4_k_m.gguf"
        if not target.exists():
            partial = target.with_name(f"{target.stem}.partial-{os.getpid()}.gguf")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
            if llama_cpp.llama_model_quantize(str(files["q4_k_m"]).encode(), str(partial).encode(),
                                              ctypes.byref(params)):
                raise RuntimeError("llama.cpp could not quantize to Q4_K_M")
            partial.replace(target)
        files["q4_k_m"] = target
    return files


class Ours:
    name = "pluginfer"

    def __init__(self, path: Path, args: argparse.Namespace, kv_cache_dtype: str = "auto") -> None:
        from pluginfer import LLM

        if kv_cache_dtype != "auto":
            self.name = f"pluginfer kv {kv_cache_dtype}"
        self.llm = LLM(model=str(path), max_model_len=1024, max_num_seqs=max(16, *args.batch_sizes),
                       enable_prefix_caching=False,
                       max_num_batched_tokens=2048, kv_cache_dtype=kv_cache_dtype)

    def decode_rate(self, prompts: list[list[int]], new_tokens: int) -> float:
        from pluginfer import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        started: set[str] = set()
        while len(started) < len(prompts):  # the prefill, to each sequence's first token (not timed)
            started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
        start = clock()
        while engine.has_unfinished_requests():  # new_tokens - 1 decode steps, as LLM.generate takes them
            engine.step(only_finished=True)
        return len(prompts) * (new_tokens - 1) / (clock() - start)

    def prefill_rate(self, prompt: list[int]) -> float:
        from pluginfer import SamplingParams

        start = clock()
        self.llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        return len(prompt) / (clock() - start)


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: one context, one batch per step, greedy argmax."""

    name = "llama.cpp"

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)  # kept alive with self
        llama_cpp.llama_log_set(self._quiet, None)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        params = llama_cpp.llama_context_default_params()
        seqs = max(16, *args.batch_sizes)
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = seqs * 512, 512, 512, seqs
        params.n_threads = params.n_threads_batch = args.threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(max(512, seqs), 0, seqs)

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, wants logits) rows in one llama_decode."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, row: int) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.vocab,))
        return int(logits.argmax())

    def decode_rate(self, prompts: list[list[int]], new_tokens: int) -> float:
        self._clear()
        for seq, prompt in enumerate(prompts):  # prefill each prompt (not timed)
            self._decode([(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        last = [self._argmax(-1)] * len(prompts)
        positions = [len(p) for p in prompts]
        start = clock()
        for _ in range(new_tokens - 1):
            self._decode([(last[s], positions[s], s, True) for s in range(len(prompts))])
            last = [self._argmax(s) for s in range(len(prompts))]
            positions = [p + 1 for p in positions]
        return len(prompts) * (new_tokens - 1) / (clock() - start)

    def prefill_rate(self, prompt: list[int]) -> float:
        self._clear()
        start = clock()
        self._decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        self._argmax(-1)
        return len(prompt) / (clock() - start)


def plot(path: Path, rates: dict[str, dict[str, dict[int, float]]], title: str) -> None:
    """Decode tokens/s against batch size: ``rates[file][engine][batch]``, one colour per file, llama.cpp
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for color, (file, engines) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4, rates.items()):
        for engine, by_batch in engines.items():
            batches = sorted(by_batch)
            ax.plot(batches, [by_batch[b] for b in batches], marker="o", color=color,
                    linestyle="--" if engine == "llama.cpp" else "-", label=f"{file}, {engine}")
    ax.set_xscale("log", base=2)
    ticks = sorted({b for engines in rates.values() for by_batch in engines.values() for b in by_batch})
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def ours_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    from pluginfer import LLM
    from pluginfer.testing.model_contract import prefill_logits

    llm = LLM(model=str(path), max_model_len=len(prompt) + 16, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, len(prompt)), kv_cache_dtype="float32")
    return prefill_logits(llm, prompt)


def llama_cpp_logits(path: Path, prompt: list[int], threads: int) -> torch.Tensor:
    import llama_cpp

    # type_k / type_v 0 (GGML_TYPE_F32): float32 KV caches in both; the default F16 ones alone move logits.
    model = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + 16, n_batch=len(prompt), n_ubatch=len(prompt),
                            logits_all=True, verbose=False, n_threads=threads, n_threads_batch=threads,
                            type_k=0, type_v=0)
    model.eval(prompt)
    return torch.tensor(np.array(model.scores[: len(prompt)]), dtype=torch.float32)


def compare_nll(files: dict[str, Path], tokens: int, threads: int) -> None:
    """Mean NLL and logits of the demo corpus's first ``tokens`` tokens, ours against llama.cpp, per file."""
    import math

    from pluginfer.demo.tokenizer import CORPUS_PATH
    from pluginfer.formats.gguf.reader import GGUFFile
    from pluginfer.formats.gguf.tokenizer import build_gguf_tokenizer

    tokenizer = build_gguf_tokenizer(GGUFFile(next(iter(files.values()))))
    prompt = tokenizer.encode(CORPUS_PATH.read_text(encoding="utf-8"))[:tokens]
    target = torch.tensor(prompt[1:])
    print(f"accuracy: {len(prompt)} tokens of the demo corpus in one prefill (log vocab "
          f"{math.log(len(tokenizer)):.4f})")
    print("format  | NLL ours | NLL llama.cpp | rel diff | max |logit diff| | logit std | top-1 agree")
    for name, path in files.items():
        ours, theirs = ours_logits(path, prompt), llama_cpp_logits(path, prompt, threads)
        nll_ours, nll_theirs = (torch.nn.functional.cross_entropy(x[:-1].double(), target).item()
                                for x in (ours, theirs))
        agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        print(f"{name:7} | {nll_ours:8.4f} | {nll_theirs:13.4f} | {(nll_ours - nll_theirs) / nll_theirs:+8.2%} | "
              f"{(ours - theirs).abs().max().item():19.4f} | {theirs.std().item():9.4f} | {agree:11.1%}", flush=True)


# --avx2 / --avx2-vnni: oneDNN's cap, and what the table's header says about the run
NARROW_ONEDNN = {"avx2": "AVX2", "avx2-vnni": "AVX2_VNNI"}
NARROW_RUNS = {
    "avx2": "AVX2 only (PLUGINFER_CPU_ISA=avx2, oneDNN and torch on AVX2, llama.cpp without AVX-512); ",
    "avx2-vnni": "AVX2 + AVX-VNNI (PLUGINFER_CPU_ISA=avx2-vnni, oneDNN on AVX2_VNNI, torch on AVX2, llama.cpp with "
                 "AVX-VNNI, without AVX-512); ",
}


def narrow_isa(args: argparse.Namespace) -> str | None:
    """The PLUGINFER_CPU_ISA that --avx2 or --avx2-vnni asks for, else None."""
    return "avx2" if args.avx2 else "avx2-vnni" if args.avx2_vnni else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--runs", type=int, default=3, help="timed runs per engine (0: no timing, with --nll)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the model and files here between runs")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                        choices=["auto", "float32", "float16", "bfloat16"],
                        help="our KV cache dtype(s), each its own engine in the interleaved runs (llama.cpp keeps "
                             "its default F16 cache)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread for both engines, each phase timed by the process's CPU time")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16],
                        help="decode batch sizes to time (sequences decoded together)")
    parser.add_argument("--no-amx", action="store_true",
                        help="our engine with PLUGINFER_AMX=0 against a llama.cpp built without AMX (checked)")
    isa = parser.add_mutually_exclusive_group()
    isa.add_argument("--avx2", action="store_true",
                     help="every kernel on AVX2 (ours, oneDNN, torch) against a llama.cpp built without AVX-512 "
                          "(checked)")
    isa.add_argument("--avx2-vnni", action="store_true",
                     help="as --avx2, with AVX-VNNI (an Alder Lake), against a llama.cpp built with AVX-VNNI and "
                          "without AVX-512 (checked)")
    parser.add_argument("--nll", type=int, default=0, metavar="TOKENS",
                        help="also compare mean NLL and logits on this many tokens of the demo corpus")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write a PNG of decode tokens/s against batch size, ours and llama.cpp's (matplotlib)")
    args = parser.parse_args()
    if min(args.batch_sizes) < 1:
        parser.error("--batch-sizes must be positive")
    if args.runs < 0 or args.nll < 0 or args.runs == 0 and not args.nll:
        parser.error("--runs must be positive (or 0 with --nll TOKENS), --nll not negative")
    if args.plot is not None:
        import matplotlib  # noqa: F401 - fail before the runs, not after them
    narrow = narrow_isa(args)
    if narrow and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        # torch reads its capability at import, so the whole run starts again with the AVX2 settings
        env = dict(os.environ, PLUGINFER_CPU_ISA=narrow, PLUGINFER_AMX="0", ONEDNN_MAX_CPU_ISA=NARROW_ONEDNN[narrow],
                   ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if narrow:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode()
        if "AVX512 = 1" in info or ("AVX_VNNI = 1" in info) != args.avx2_vnni:
            parser.error(f"--{narrow}: {llama_cpp.__file__} was built {'with' if 'AVX512 = 1' in info else 'without'} "
                         f"AVX-512, {'with' if 'AVX_VNNI = 1' in info else 'without'} AVX-VNNI; build it with AVX2"
                         f"{' and AVX-VNNI' if args.avx2_vnni else ''} only (docs/performance.md) and put it first "
                         "on PYTHONPATH")
    if args.no_amx:
        import llama_cpp

        if "AMX" in llama_cpp.llama_print_system_info().decode():
            parser.error("--no-amx: this llama.cpp was built with AMX; build it without (docs/performance.md)")
        os.environ["PLUGINFER_AMX"] = "0"  # before our cpu backend loads
    if args.cpu_time:
        global clock
        clock, args.threads = time.process_time, 1
    args.arch, args.experts, args.top_k = "llama", 0, 0
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        root = args.work_dir or Path(tmp)
        model_dir = root / "hf"
        if not (model_dir / "config.json").exists():
            build_checkpoint(model_dir, args)
        files = write_files(model_dir, root, args.formats)
        if args.runs:
            time_files(files, args)
        if args.nll:
            compare_nll(files, args.nll, args.threads)


def linear_flops(args: argparse.Namespace, head: bool) -> float:
    """Multiply-add FLOPs of one token through the model's linear layers (the LM head with ``head``)."""
    kv_width = args.kv_heads * (args.hidden // args.heads)
    per_layer = 2 * args.hidden * args.hidden + 2 * args.hidden * kv_width + 3 * args.hidden * args.intermediate
    return 2.0 * (args.layers * per_layer + (args.vocab * args.hidden if head else 0))


def float32_gemm_rate(args: argparse.Namespace) -> float:
    """FLOP/s of torch's float32 GEMM (512 rows x the MLP's shape) on this run's threads, by this run's clock:
    the multiply-add rate our engine's float32 arithmetic cannot pass."""
    x, weight = torch.randn(512, args.hidden), torch.randn(args.hidden, args.intermediate)
    torch.mm(x, weight)
    seconds = []
    for _ in range(7):
        started = clock()
        torch.mm(x, weight)
        seconds.append(clock() - started)
    return 2.0 * 512 * args.hidden * args.intermediate / statistics.median(seconds)


def time_files(files: dict[str, Path], args: argparse.Namespace) -> None:
    """The speed table (and the plot): each engine's decode and prefill tokens/s per file, runs interleaved."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, args.vocab - 10, 128).tolist() for _ in range(max(args.batch_sizes))]
    long_prompt = rng.integers(10, args.vocab - 10, 512).tolist()
    bandwidth = memory_bandwidth("cpu", torch.float32)
    print(f"llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; {args.threads} threads; "
          f"{'no AMX (PLUGINFER_AMX=0, llama.cpp without AMX); ' if args.no_amx else ''}"
          f"{NARROW_RUNS.get(narrow_isa(args), '')}"
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s; timed by {'CPU time' if args.cpu_time else 'wall clock'}")
    measures = [*args.batch_sizes, "prefill"]
    print("format   file MB  bound b1 | " + " | ".join(f"batch-{b} tok/s" for b in args.batch_sizes)
          + " | prefill-512 tok/s   (each: ours / llama.cpp (ratio))")
    rates: dict[str, dict[str, dict[int, float]]] = {}
    for name, path in files.items():
        engines = [*(Ours(path, args, kv) for kv in args.kv_cache_dtypes), LlamaCpp(path, args)]
        results = {engine.name: {measure: [] for measure in measures} for engine in engines}
        for _ in range(args.runs):
            for engine in engines:  # interleaved
                for batch in args.batch_sizes:
                    results[engine.name][batch].append(
                        engine.decode_rate(prompts[:batch], 128 if batch == 1 else 32))
                results[engine.name]["prefill"].append(engine.prefill_rate(long_prompt))
        size = path.stat().st_size
        rates[name] = {engine: {b: statistics.median(results[engine][b]) for b in args.batch_sizes}
                       for engine in results}
        for ours_name in (engine.name for engine in engines[:-1]):
            cells = []
            for measure in measures:
                ours, theirs = (statistics.median(results[e][measure]) for e in (ours_name, "llama.cpp"))
                cells.append(f"{ours:7.1f} / {theirs:7.1f} ({ours / theirs:4.2f}x)")
            label = name if len(engines) == 2 else f"{name} ({ours_name.removeprefix('pluginfer').strip() or 'kv auto'})"
            print(f"{label:7s} {size / 1e6:8.1f} {bandwidth / size:7.1f}  | " + " | ".join(cells), flush=True)
        del engines
    if "f16" in files:
        # a 16-bit file runs float32 activations against its weights: bounded by float32 multiply-adds
        rate, with_head, without = float32_gemm_rate(args), linear_flops(args, True), linear_flops(args, False)
        prefill = rate * 512 / (511 * without + with_head)  # the head for the last position only
        print(f"f16 file, the float32 multiply-add bound of its linears alone (torch's float32 GEMM at 512 rows: "
              f"{rate / 1e9:.1f} GFLOP/s): decode <= {rate / with_head:.1f} tok/s at any batch, "
              f"prefill-512 <= {prefill:.1f} tok/s")
    if args.plot is not None:
        plot(args.plot, rates, f"llama {args.layers} layers, hidden {args.hidden}; {args.threads} threads; "
             f"{'CPU time' if args.cpu_time else 'wall clock'}")
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
