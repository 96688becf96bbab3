"""Mean NLL and per-token logits of a text on the default path against llama.cpp, on the same GGUF files.

    python benchmarks/gguf_nll.py                               # 0.5B-shaped llama, Q8_0 Q4_0 Q4_K_M, 512 tokens
    python benchmarks/gguf_nll.py --layers 2 --formats q4_0     # quick smoke run
    python benchmarks/gguf_nll.py --work-dir /tmp/nll          # keep the checkpoint and files between runs

The model is vs_llamacpp.py's random llama (same shape, our offline tokenizer, padded vocabulary), written as
F16 by ``pluginfer convert`` and quantized from that file by llama.cpp's own quantizer (``llama_model_quantize``
of llama-cpp-python) to each type: llama.cpp chose every block. The text is the demo corpus, tokenized by the
file's tokenizer. Each engine runs the whole text in one prefill with float32 KV caches; ours on its default
path (int8 activations against the GGML blocks, as llama.cpp's Q8_K / Q8_0 activations).

Printed per file: both mean NLLs and their relative difference, the largest absolute logit difference, the
logits' spread (for scale), and how often both engines pick the same top-1 token. With random weights the
logits are nearly flat and NLL sits near log(vocab) for both engines; the logit difference and the top-1
agreement are the sharper comparison.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import build_checkpoint  # noqa: E402

QUANTIZER_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
                   "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def write_files(model_dir: Path, out: Path, formats: list[str]) -> dict[str, Path]:
    """F16 by ``pluginfer convert``, then each of ``formats`` by llama.cpp's quantizer (each written once)."""
    import llama_cpp

    f16 = out / "nll-f16.gguf"
    if not f16.exists():
        partial = f16.with_name(f"{f16.stem}.partial-{os.getpid()}.gguf")
        subprocess.run([sys.executable, "-m", "pluginfer", "convert", "--model", str(model_dir), "--quant", "f16",
                        "--embedding-type", "f16", "--output", str(partial)], check=True)
        partial.replace(f16)
    files = {}
    for name in formats:
        target = out / f"nll-{name}.gguf"
        if not target.exists():
            partial = target.with_name(f"{target.stem}.partial-{os.getpid()}.gguf")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, QUANTIZER_TYPES[name])
            if llama_cpp.llama_model_quantize(str(f16).encode(), str(partial).encode(), ctypes.byref(params)):
                raise RuntimeError(f"llama.cpp could not quantize to {name}")
            partial.replace(target)
        files[name] = target
    return files


def ours_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    from pluginfer import LLM
    from pluginfer.testing.model_contract import prefill_logits

    llm = LLM(model=str(path), max_model_len=len(prompt) + 16, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, len(prompt)))
    return prefill_logits(llm, prompt)


def llama_cpp_logits(path: Path, prompt: list[int], threads: int) -> torch.Tensor:
    import llama_cpp

    # type_k / type_v 0 (GGML_TYPE_F32): a float32 KV cache as ours; its default F16 cache alone moves logits.
    model = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + 16, n_batch=len(prompt), n_ubatch=len(prompt),
                            logits_all=True, verbose=False, n_threads=threads, n_threads_batch=threads,
                            type_k=0, type_v=0)
    model.eval(prompt)
    return torch.tensor(np.array(model.scores[: len(prompt)]), dtype=torch.float32)


def mean_nll(logits: torch.Tensor, prompt: list[int]) -> float:
    """The mean negative log-likelihood of each next token of ``prompt``."""
    return torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(prompt[1:])).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--formats", nargs="+", default=list(QUANTIZER_TYPES), choices=list(QUANTIZER_TYPES))
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the text, run as one prefill")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the model and files here between runs")
    args = parser.parse_args()
    args.arch, args.experts, args.top_k = "llama", 0, 0
    torch.set_num_threads(args.threads)

    from pluginfer.demo.tokenizer import CORPUS_PATH
    from pluginfer.formats.gguf.reader import GGUFFile
    from pluginfer.formats.gguf.tokenizer import build_gguf_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        root = args.work_dir or Path(tmp)
        model_dir = root / "hf"
        if not (model_dir / "config.json").exists():
            build_checkpoint(model_dir, args)
        files = write_files(model_dir, root, args.formats)
        tokenizer = build_gguf_tokenizer(GGUFFile(next(iter(files.values()))))
        prompt = tokenizer.encode(CORPUS_PATH.read_text(encoding="utf-8"))[: args.tokens]
        print(f"llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} (log vocab "
              f"{math.log(args.vocab):.4f}); {len(prompt)} tokens of the demo corpus; {args.threads} threads")
        print("format  | NLL ours | NLL llama.cpp | rel diff | max |logit diff| | logit std | top-1 agree")
        for name, path in files.items():
            ours, theirs = ours_logits(path, prompt), llama_cpp_logits(path, prompt, args.threads)
            nll_ours, nll_theirs = mean_nll(ours, prompt), mean_nll(theirs, prompt)
            agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
            print(f"{name:7} | {nll_ours:8.4f} | {nll_theirs:13.4f} | {(nll_ours - nll_theirs) / nll_theirs:+8.2%} | "
                  f"{(ours - theirs).abs().max().item():19.4f} | {theirs.std().item():9.4f} | {agree:11.1%}")


if __name__ == "__main__":
    main()
