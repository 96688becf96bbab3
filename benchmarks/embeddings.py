"""Embeddings per second at batch 32: LLM.embed against sentence-transformers on the same checkpoint.

    python benchmarks/embeddings.py                          # hidden 512, 8 layers, 128-token inputs
    python benchmarks/embeddings.py --hidden 1024 --layers 28 --heads 16 --kv-heads 8 --tokens 64   # 0.6B-shaped
    python benchmarks/embeddings.py --pooling mean --threads 2 --repeats 7

A random Qwen3 decoder (Qwen3-Embedding's architecture: last-token pooling, Normalize; or mean / CLS)
is built with transformers and saved by sentence-transformers itself in a temporary directory; its
tokenizer is the demo tokenizer (2k entries). One batch is 32 inputs of ``--tokens`` random token ids
(the same ids for both), embedded by ``LLM.embed`` (one engine request each, batched by the
scheduler: ``max_num_batched_tokens`` is raised so that the batch is one step, prefix caching off so
that every repeat computes) and by ``SentenceTransformer.encode(batch_size=32)`` on pre-tokenized
inputs (``forward`` on the padded batch: no tokenization in the timing). Runs are interleaved, medians
of ``--repeats``; the ratio is what to read on a shared machine. Both sides use ``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build(root: Path, args: argparse.Namespace) -> Path:
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from pluginfer.demo.tokenizer import train_tokenizer

    tokenizer_dir = train_tokenizer(root / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                         max_position_embeddings=max(512, args.tokens), tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    lm = root / "lm"
    Qwen3ForCausalLM(config).eval().save_pretrained(lm)
    tokenizer.save_pretrained(lm)
    (lm / "chat_template.jinja").unlink(missing_ok=True)
    transformer = Transformer(str(lm))
    modes = {"last": "lasttoken", "mean": "mean", "cls": "cls"}
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=modes[args.pooling])]
    if args.pooling != "mean":
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "model"))
    return root / "model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per input")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--pooling", choices=["last", "mean", "cls"], default="last")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from pluginfer import LLM

    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp), args)
        params = sum(t.numel() for t in SentenceTransformer(str(path), device="cpu").parameters())
        rng = random.Random(0)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        batch = [[rng.randrange(10, vocab) for _ in range(args.tokens)] for _ in range(args.batch)]

        llm = LLM(str(path), dtype="float32", max_num_batched_tokens=args.batch * args.tokens,
                  max_num_seqs=args.batch, enable_prefix_caching=False, max_model_len=max(512, args.tokens))
        reference = SentenceTransformer(str(path), device="cpu")
        reference.tokenizer.pad_token = reference.tokenizer.eos_token
        features = {"input_ids": torch.tensor(batch), "attention_mask": torch.ones(args.batch, args.tokens,
                                                                                   dtype=torch.long)}

        def ours() -> torch.Tensor:
            return torch.tensor([o.embedding for o in llm.embed(batch)])

        def theirs() -> torch.Tensor:
            with torch.inference_mode():
                return reference.forward(dict(features))["sentence_embedding"]

        difference = (ours() - theirs()).abs().max().item()  # also the warm-up of both
        times: dict[str, list[float]] = {"pluginfer": [], "sentence-transformers": []}
        for _ in range(args.repeats):
            for name, run in (("pluginfer", ours), ("sentence-transformers", theirs)):
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
        llm.close()

    print(f"random Qwen3 {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers), "
          f"{args.pooling} pooling, batch {args.batch} x {args.tokens} tokens, {args.threads} torch threads, "
          f"float32; max |difference| {difference:.2e}")
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"  {name:22s} {args.batch / median:8.1f} embeddings/s  ({median * 1000:.0f} ms per batch, "
              f"min {args.batch / max(times[name]):.1f}, max {args.batch / min(times[name]):.1f})")
    print(f"  pluginfer / sentence-transformers: {medians['sentence-transformers'] / medians['pluginfer']:.2f}x")


if __name__ == "__main__":
    main()
