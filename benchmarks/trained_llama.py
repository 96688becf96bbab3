"""A small llama trained here, on this machine's Python standard library, then widened to a bigger shape that
computes the very same function: a model that has learned something (here, to copy a function with an edit) at the
cost of a real model of the bigger shape. No hub and no download: the tokenizer, the data and the weights are made
in a few minutes on the CPU, seeded, and kept in a work directory.

- ``code_edit_examples``: functions of the standard library (``ast``), each a prompt ("rename NAME to NEW in this
  function", the function) and an answer (the function with the rename): the answer mostly repeats the prompt.
- ``prose_examples``: the standard library's docstrings as a chat: a user asks what a module, class or function does,
  the assistant answers with its docstring.
- ``distill``: a model's greedy answers to prompts, which a draft model is trained on (so that it proposes what
  that model says, not what the texts said).
- ``train``: a llama of ``hidden``/``layers`` (head size 64) trained on such texts (AdamW, one thread), after
  ``copy_steps`` steps on rows of random tokens repeated once (the loss on the repeat): a model of this size learns
  to copy its context there (an induction head, a few hundred steps in), which the texts alone did not teach it in
  1500 steps (a trained 2-layer model answered with 1-4 tokens of the function it was to repeat).
- ``widen``: the same model at a bigger shape: hidden size, heads, KV heads and intermediate size zero-padded
  (each extra head attends and adds nothing, each extra feature stays zero), RMSNorm's weights and epsilon scaled by
  ``d_small / d_big`` (the mean of squares runs over the padded width), and layers added whose attention output and
  MLP down projections are zero (the residual passes through). Its logits are the small model's.
"""

from __future__ import annotations

import ast
import json
import math
import random
import sysconfig
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch

HEAD_DIM = 64  # the widened shapes keep the small model's head size (rotary and softmax scale depend on it)
CODE_START, CODE_END = "<|im_start|>", "<|im_end|>"


def _functions(limit: int) -> list[tuple[str, list[str]]]:
    """(source, names used at least twice) of short functions of the standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not 6 <= node.end_lineno - node.lineno <= 24:
                continue
            text = textwrap.dedent(ast.get_source_segment(source, node) or "")
            if not text or "\t" in text or len(text) > 1200:
                continue
            counts: dict[str, int] = {}
            for inner in ast.walk(node):
                if isinstance(inner, ast.Name) and len(inner.id) > 2:
                    counts[inner.id] = counts.get(inner.id, 0) + 1
            names = sorted(name for name, count in counts.items() if count >= 2)
            if names:
                found.append((text, names))
            if len(found) >= limit:
                return found
    return found


def _rename(source: str, old: str, new: str) -> str:
    out, word = [], []
    for char in source + "\n":
        if char.isalnum() or char == "_":
            word.append(char)
            continue
        if word:
            out.append(new if "".join(word) == old else "".join(word))
            word = []
        out.append(char)
    return "".join(out)[:-1]


def code_edit_examples(count: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: a standard-library function and the instruction, then the function renamed."""
    rng = random.Random(seed)
    functions = _functions(count)
    examples = []
    for source, names in functions:
        old = rng.choice(names)
        new = rng.choice(["value", "item", "result", "data", "entry", "target"]) + f"_{rng.randrange(10)}"
        prompt = f"{CODE_START}user\nRename {old} to {new} in this function:\n{source}\n{CODE_END}\n{CODE_START}assistant\n"
        examples.append((prompt, _rename(source, old, new) + f"\n{CODE_END}\n"))
    return examples


def prose_examples(count: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: a user asks what a standard-library module, class or function does, the assistant
    answers with its docstring (public names, docstrings of 100-1500 characters)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    examples = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]:
            doc = ast.get_docstring(node)
            if not doc or not 100 <= len(doc) <= 1500 or node is not tree and node.name.startswith("_"):
                continue
            kind = "module" if node is tree else "class" if isinstance(node, ast.ClassDef) else "function"
            name = path.stem if node is tree else f"{path.stem}.{node.name}"
            prompt = f"{CODE_START}user\nWhat does the {name} {kind} do?\n{CODE_END}\n{CODE_START}assistant\n"
            examples.append((prompt, doc.strip() + f"\n{CODE_END}\n"))
    random.Random(seed).shuffle(examples)
    return examples[:count]


def train_tokenizer(texts: list[str], out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` trained on ``texts``, saved as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pluginfer.demo.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                      additional_special_tokens=SPECIAL_TOKENS[3:], clean_up_tokenization_spaces=False,
                                      model_max_length=4096)
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(out)


def copy_rows(rng: random.Random, count: int, length: int, low: int, high: int, pad: int) -> tuple[list, list]:
    """``count`` rows of ``length``: a segment of 16-60 random tokens in ``[low, high)`` and the segment again, the
    labels on the repeat only."""
    ids, labels = [], []
    for _ in range(count):
        segment = [rng.randrange(low, high) for _ in range(rng.randrange(16, min(61, length // 2)))]
        row, label = [pad] + segment + segment, [-100] * (len(segment) + 1) + segment
        ids.append(row + [pad] * (length - len(row)))
        labels.append(label + [-100] * (length - len(label)))
    return ids, labels


def train(out: Path, tokenizer_dir: Path, examples: list[tuple[str, str]], hidden: int, layers: int, steps: int,
          seed: int, batch: int = 8, seq_len: int = 384, log: bool = True, copy_steps: int = 0) -> None:
    """A llama of ``hidden`` (heads of 64) and ``layers`` trained ``steps`` AdamW steps on the examples, one example a
    row (cut at ``seq_len`` tokens), the loss on the answers' tokens only (what to learn is to answer: to copy),
    saved with the tokenizer in ``out``; first ``copy_steps`` steps of 32 :func:`copy_rows` of 128 tokens."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rows = []
    for prompt, answer in examples:
        asked, answered = (tokenizer.encode(text, add_special_tokens=False) for text in (prompt, answer))
        ids = (asked + answered)[:seq_len]
        labels = ([-100] * len(asked) + answered)[:seq_len]
        pad = seq_len - len(ids)
        rows.append((ids + [tokenizer.eos_token_id] * pad, labels + [-100] * pad))
    torch.manual_seed(seed)
    heads = hidden // HEAD_DIM
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         head_dim=HEAD_DIM, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids(CODE_END))
    model = LlamaForCausalLM(config)
    rng = random.Random(seed)
    low = max(tokenizer.all_special_ids) + 1  # copied segments: any token but the special ones
    _run(model, copy_steps, lambda step: 2e-3 * min(1.0, (step + 1) / 100),
         lambda: copy_rows(rng, 32, 128, low, len(tokenizer), tokenizer.eos_token_id),
         f"{out.name}: copy step" if log else None)

    def texts() -> tuple[list, list]:
        chosen = [rows[rng.randrange(len(rows))] for _ in range(batch)]
        return [row[0] for row in chosen], [row[1] for row in chosen]

    _run(model, steps, lambda step: 3e-3 * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps)),
         texts, f"{out.name}: step" if log else None)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def distill(model_dir: Path, tokenizer_dir: Path, prompts: list[str], max_new: int = 160,
            batch: int = 64) -> list[tuple[str, str]]:
    """(prompt, the model's greedy answer) for each prompt, to its end-of-turn token or ``max_new`` tokens: what a
    draft model learns from, so that it proposes what this model says (as draft models are distilled)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.padding_side, tokenizer.pad_token = "left", tokenizer.eos_token
    model = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    end = tokenizer.convert_tokens_to_ids(CODE_END)
    pairs = []
    for first in range(0, len(prompts), batch):
        chunk = prompts[first:first + batch]
        encoded = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=max_new, do_sample=False, eos_token_id=end,
                                 pad_token_id=tokenizer.eos_token_id)
        for prompt, answer in zip(chunk, out[:, encoded["input_ids"].shape[1]:].tolist()):
            pairs.append((prompt, tokenizer.decode(answer[:answer.index(end) + 1] if end in answer else answer)))
    return pairs


def _run(model: torch.nn.Module, steps: int, lr_at: Callable[[int], float], batch_of: Callable[[], tuple[list, list]],
         log_as: str | None) -> None:
    """``steps`` AdamW steps (a fresh optimizer) on the batches ``batch_of`` draws, at the learning rate ``lr_at``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.01, betas=(0.9, 0.98))
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        ids, labels = batch_of()
        loss = model(input_ids=torch.tensor(ids), labels=torch.tensor(labels)).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if log_as and (step % 100 == 0 or step == steps - 1):
            print(f"  train {log_as} {step}, loss {loss.item():.3f}", flush=True)


def widen(small: Path, out: Path, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> None:
    """``small`` at the shape given, computing the same logits (see the module's docstring)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    config = json.loads((small / "config.json").read_text())
    d, n, nkv, inter = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                        config["intermediate_size"])
    if config.get("head_dim", d // n) != HEAD_DIM or hidden % HEAD_DIM or heads * HEAD_DIM != hidden:
        raise ValueError(f"widen keeps heads of {HEAD_DIM}: {heads} heads of hidden {hidden}")
    if hidden < d or heads < n or kv_heads < nkv or intermediate < inter or layers < config["num_hidden_layers"]:
        raise ValueError("widen only grows a model")
    if heads // kv_heads != n // nkv:  # the same query heads must share each key/value head
        raise ValueError(f"widen keeps the grouping of query heads: {n}/{nkv} is not {heads}/{kv_heads}")
    shrink = math.sqrt(d / hidden)
    weights = load_file(small / "model.safetensors")

    def pad(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        grown = torch.zeros(shape, dtype=tensor.dtype)
        grown[tuple(slice(0, size) for size in tensor.shape)] = tensor
        return grown

    grown = {"model.embed_tokens.weight": pad(weights["model.embed_tokens.weight"], (config["vocab_size"], hidden)),
             "lm_head.weight": pad(weights["lm_head.weight"], (config["vocab_size"], hidden)),
             "model.norm.weight": pad(weights["model.norm.weight"] * shrink, (hidden,))}
    shapes = {"self_attn.q_proj": (heads * HEAD_DIM, hidden), "self_attn.k_proj": (kv_heads * HEAD_DIM, hidden),
              "self_attn.v_proj": (kv_heads * HEAD_DIM, hidden), "self_attn.o_proj": (hidden, heads * HEAD_DIM),
              "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
              "mlp.down_proj": (hidden, intermediate)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            small_norm = weights.get(f"{prefix}{norm}.weight", torch.ones(d))  # added layers: any norm (no output)
            grown[f"{prefix}{norm}.weight"] = pad(small_norm * shrink, (hidden,))
        for name, shape in shapes.items():
            key = f"{prefix}{name}.weight"
            grown[key] = pad(weights[key], shape) if key in weights else torch.zeros(shape)
    config.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
                  intermediate_size=intermediate, num_hidden_layers=layers, rms_norm_eps=config["rms_norm_eps"] * d / hidden)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in grown.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(str(small)).save_pretrained(out)
    for extra in ("generation_config.json",):
        if (small / extra).exists():
            (out / extra).write_text((small / extra).read_text())


def build(work: Path, workload: str, shape: dict, steps: int, log: bool = True,
          copy_steps: int = 1000) -> tuple[Path, Path, list[str]]:
    """(the widened model, the small draft model, held-out prompts) of ``workload`` (``code-edit`` or ``chat``), made
    once in ``work``: the tokenizer, the small model (hidden 128, 2 layers, ``copy_steps`` of copying first) and its
    widening to ``shape``, and for the chat a draft (hidden 64, 1 layer, another seed) distilled from the small
    model: trained on its greedy answers to the training prompts."""
    examples = code_edit_examples(3000, 0) if workload == "code-edit" else prose_examples(3000, 0)
    train_set, held_out = examples[:-16], examples[-16:]
    base = work / workload
    if not (base / "tokenizer" / "tokenizer.json").exists():
        train_tokenizer([p + a for p, a in train_set], base / "tokenizer", 4096)
    if not (base / "small" / "model.safetensors").exists():
        train(base / "small", base / "tokenizer", train_set, hidden=128, layers=2, steps=steps, seed=0, log=log,
              copy_steps=copy_steps)
    if workload == "chat" and not (base / "draft" / "model.safetensors").exists():  # prompt lookup needs none
        answers = distill(base / "small", base / "tokenizer", [prompt for prompt, _ in train_set])
        train(base / "draft", base / "tokenizer", answers, hidden=64, layers=1, steps=steps, seed=1, log=log)
    if not (base / "wide" / "model.safetensors").exists():
        widen(base / "small", base / "wide", **shape)
    return base / "wide", base / "draft", [prompt for prompt, _ in held_out]


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--workload", choices=["code-edit", "chat"], default="code-edit")
    parser.add_argument("--steps", type=int, default=1500, help="training steps of each small model")
    parser.add_argument("--copy-steps", type=int, default=1000, help="copying steps before them (the 2-layer model)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    wide, draft, _ = build(args.work_dir, args.workload, dict(hidden=args.hidden, layers=args.layers, heads=args.heads,
                                                              kv_heads=args.kv_heads, intermediate=args.intermediate),
                           args.steps, copy_steps=args.copy_steps)
    print(f"widened model: {wide}\ndraft model: {draft}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
