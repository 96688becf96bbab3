"""Structured-output overhead: grammar compile, and per-token mask + apply, against unconstrained decoding.

    python benchmarks/structured_output.py                      # vocab 32k and 128k, batch 1 and 16
    python benchmarks/structured_output.py --vocab 32000 --steps 32 --repeats 3   # quicker

The tokenizers are byte-level BPEs trained on the Python sources of this interpreter's site-packages
(real-looking merges at Llama-2 and Llama-3 vocabulary sizes; the demo tokenizer has 2k entries).
The grammar is a JSON schema that never completes (an array of at least 100000 bounded objects),
so constrained and free sequences decode the same number of tokens.

1. compile: llguidance's tokenizer view (once per model), a schema compiled cold, and the cached
   path the engine takes per request (``GrammarCompiler.matcher``: cache hit + copy).
2. sampler: one ``Sampler`` call on random [batch, vocab] logits with and without the grammar
   (the mask fill, unpack and -inf fill, plus advancing each matcher), steps interleaved.
3. end to end: ``LLM.generate`` on a random llama (hidden 256, 4 layers) with and without
   ``structured_outputs``, runs interleaved; ms per step (4-token prompts: decode dominates), median
   of the repeats.

One torch thread by default (``--threads``): on a shared, loaded machine two threads' barriers
make step times swing by 10x, one thread's do not.
"""

from __future__ import annotations

import argparse
import site
import statistics
import tempfile
import time
from pathlib import Path

import torch

ITEM = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                       "name": {"type": "string", "maxLength": 12},
                       "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}}}
ENDLESS = {"type": "array", "items": ITEM, "minItems": 100000}


def build_tokenizer(out: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (out / "tokenizer.json").is_file():
        return out
    root = Path(site.getsitepackages()[0])
    budget = 60_000_000 if vocab_size > 50_000 else 20_000_000

    def texts():  # noqa: ANN202
        total = 0
        for path in sorted(root.rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            total += len(text)
            yield text
            if total > budget:
                return

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return out


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def compile_figures(tokenizer: object, vocab: int, repeats: int) -> dict[str, float]:
    from pluginfer.engine.structured import GrammarCompiler, StructuredOutputsParams

    params = StructuredOutputsParams(json=ENDLESS)
    view, cold, cached = [], [], []
    for _ in range(repeats):
        compiler = GrammarCompiler(tokenizer, vocab, {1})
        start = time.perf_counter()
        compiler._tokenizer()
        view.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(params)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.matcher(params)
        cached.append(time.perf_counter() - start)
    return {"tokenizer view": median_ms(view), "compile (cold)": median_ms(cold),
            "matcher (cached)": median_ms(cached)}


def sampler_figures(tokenizer: object, vocab: int, batch: int, steps: int) -> tuple[float, float, float]:
    """(ms per step free, ms per step constrained, of which the mask fill)."""
    from pluginfer.engine.sampler import Sampler
    from pluginfer.engine.sequence import SamplingParams, Sequence
    from pluginfer.engine.structured import (
        GrammarCompiler,
        StructuredOutputsParams,
        accept_token,
        fill_token_bitmask,
    )

    compiler = GrammarCompiler(tokenizer, vocab, {1})
    grammar = StructuredOutputsParams(json=ENDLESS)
    free = [Sequence("f", [5], SamplingParams(temperature=1.0, seed=i)) for i in range(batch)]
    bound = [Sequence("b", [5], SamplingParams(temperature=1.0, seed=i, structured_outputs=grammar))
             for i in range(batch)]
    for seq in bound:
        seq.grammar = compiler.matcher(grammar)
    # Matchers of their own that follow the same tokens: the fill is timed on them, so that no
    # mask computed for the timing is reused by the sampler's own fill.
    shadows = [compiler.matcher(grammar) for _ in range(batch)]
    sampler = Sampler(vocab, {1})
    generator = torch.Generator().manual_seed(0)
    free_times, bound_times, fill_times = [], [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=generator) * 4
        start = time.perf_counter()
        sampler(logits, free)
        free_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        tokens = sampler(logits, bound).token_ids
        for seq, token in zip(bound, tokens):
            accept_token(seq.grammar, token)
        bound_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        fill_token_bitmask(shadows, vocab)
        fill_times.append(time.perf_counter() - start)
        for shadow, token in zip(shadows, tokens):
            shadow.consume_token(token)
    return median_ms(free_times), median_ms(bound_times), median_ms(fill_times)


def end_to_end(path: Path, vocab: int, batch: int, steps: int, repeats: int) -> tuple[float, float]:
    """(ms per decode step free, constrained) of LLM.generate, runs interleaved."""
    from pluginfer import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model=str(path), dtype="float32", max_num_seqs=batch, enable_prefix_caching=False)
    prompts = [[5 + i, 6, 7, 8] for i in range(batch)]
    grammar = StructuredOutputsParams(json=ENDLESS)
    free = SamplingParams(temperature=1.0, seed=1, max_tokens=steps, ignore_eos=True)
    bound = SamplingParams(temperature=1.0, seed=1, max_tokens=steps, ignore_eos=True, structured_outputs=grammar)
    llm.generate(prompts, bound)  # warm up, and compile the grammar once
    free_times, bound_times = [], []
    for _ in range(repeats):
        for params, times in ((free, free_times), (bound, bound_times)):
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            times.append((time.perf_counter() - start) / steps)
            assert all(len(o.outputs[0].token_ids) == steps for o in outs)
    llm.close()
    return median_ms(free_times), median_ms(bound_times)


def build_model(out: Path, tokenizer_dir: Path, vocab: int) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "pluginfer-structured-bench")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for vocab in args.vocab:
        tokenizer_dir = build_tokenizer(args.work_dir / f"tokenizer-{vocab}", vocab)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        compiled = compile_figures(tokenizer, vocab, args.repeats)
        print(f"\nvocab {vocab}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in compiled.items()))
        model = build_model(args.work_dir / f"llama-{vocab}", tokenizer_dir, vocab)
        print("| batch | sampler free | sampler + grammar | of which mask fill | step free "
              "| step + grammar | overhead per step |")
        print("|---|---|---|---|---|---|---|")
        for batch in args.batch:
            free, bound, fill = sampler_figures(tokenizer, vocab, batch, args.steps)
            step_free, step_bound = end_to_end(model, vocab, batch, args.steps, args.repeats)
            print(f"| {batch} | {free:.2f} ms | {bound:.2f} ms | {fill:.2f} ms | {step_free:.2f} ms "
                  f"| {step_bound:.2f} ms | {step_bound - step_free:+.2f} ms ({step_bound / step_free - 1:+.0%}) |",
                  flush=True)


if __name__ == "__main__":
    main()
