"""Tiny random Hugging Face checkpoints for oracle tests (transformers builds and saves them)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)


def save_hf_model(arch: str, config_kwargs: dict, out_dir: Path, tokenizer_dir: Path, seed: int = 0,
                  dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> torch.nn.Module:
    """Build ``transformers.<arch>`` from a config, save it with its tokenizer, return the model."""
    import transformers
    from transformers import AutoTokenizer

    model_cls = getattr(transformers, arch)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = model_cls.config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=None, **config_kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    copy_tokenizer(tokenizer_dir, out_dir)
    return model


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of one prompt, never stopping early."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_logits(model: torch.nn.Module, prompt_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids])).logits[0].float()


def hf_beams(model: torch.nn.Module, prompt: list[int], params, eos: int | None) -> tuple[list[list[int]], list[float]]:
    """transformers' ``generate(num_beams=...)`` under ``params`` (a ``BeamSearchParams``): its beams (generated
    tokens, padded with EOS, as it pads them) and their scores."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), num_beams=params.beam_width,
                             num_return_sequences=params.beam_width, max_new_tokens=params.max_tokens,
                             do_sample=False, early_stopping=params.early_stopping,
                             length_penalty=params.length_penalty, eos_token_id=eos, pad_token_id=eos,
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()


def padded(beam_tokens: list[int], width: int, fill: int) -> list[int]:
    """A beam's tokens padded with ``fill`` to ``width``, as transformers returns beams of a search."""
    return beam_tokens + [fill] * (width - len(beam_tokens))


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, ids drawn (seeded) from [10, vocab): clear of special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = 32):  # SamplingParams
    from pluginfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prefill_logits(llm, prompt: list[int]) -> torch.Tensor:  # pluginfer.LLM
    """Logits at every prompt position through our runner (the public API only exposes the last)."""
    from pluginfer.testing.model_contract import prefill_logits

    return prefill_logits(llm, prompt)


def save_family_checkpoints(out_root: Path, tokenizer_dir: Path, architectures: dict[str, tuple[str, dict]],
                            base: dict) -> dict[str, Path]:
    """One tiny checkpoint per family: ``{family: (hf_architecture, config overrides)}`` -> directories."""
    paths = {}
    for family, (arch, overrides) in architectures.items():
        paths[family] = out_root / family
        save_hf_model(arch, {**base, **overrides}, paths[family], tokenizer_dir)
    return paths


def copy_with_config(source: Path, target: Path, changes: dict) -> Path:
    """A copy of a checkpoint whose config.json has ``changes`` applied."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def assert_config_rejected(source: Path, target: Path, changes: dict, pattern: str) -> None:
    """Loading ``source`` with ``changes`` in its config.json fails with a ValueError matching ``pattern``."""
    import pytest

    from pluginfer import LLM

    path = copy_with_config(source, target, changes)
    with pytest.raises(ValueError, match=pattern):
        LLM(model=str(path), dtype="float32", num_blocks=16, block_size=8)
