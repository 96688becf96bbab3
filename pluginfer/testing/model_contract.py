"""Conformance kit: a ``ModelPipeline`` plugin against the transformers model it reimplements, through the engine.

``check_model_pipeline(reference_class, config)`` builds a tiny random ``reference_class`` from ``config``, saves
it with a small tokenizer, loads it with ``pluginfer.LLM`` as any user would and raises AssertionError on the
first broken promise: the architecture resolves to the plugin, every position's float32 prefill logits and the
batched greedy tokens equal transformers', ``load_weights`` and ``bind_kv_caches`` reject what they must.
Generation ignores EOS (random weights rarely end on it). docs/plugins.md lists every check.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pluginfer.core.protocols import KVCacheSpec, ModelPipeline
from pluginfer.core.registry import get_registry

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
ENGINE_DEFAULTS = dict(dtype="float32", num_blocks=64, block_size=8)


def check_model_pipeline(reference_class: type, config: dict[str, Any], plugin: str | None = None,
                         workdir: str | Path | None = None, prompt_lengths: tuple[int, ...] = (7, 19, 30),
                         max_tokens: int = 16, atol: float = 1e-4, seed: int = 0, **engine: Any) -> dict[str, Any]:
    """Check the model plugin serving ``reference_class`` against it; returns what was compared.

    ``config``: keyword arguments of ``reference_class.config_class`` (hidden 64-256, 2-4 layers; the vocabulary
    comes from the kit's tokenizer unless given). ``plugin``: the model plugin's name the architecture must
    resolve to. ``workdir``: where the checkpoint is written (default: a temporary directory, removed after).
    ``engine``: ``pluginfer.LLM`` keywords (``backend="cuda"``, ...) over ``dtype=float32, num_blocks=64,
    block_size=8``. Returns ``{"max_logit_error": ..., "tokens": [...]}``.
    """
    architecture = reference_class.__name__
    if plugin is not None:
        resolved = get_registry().resolve("model", architecture).name
        if resolved != plugin:
            raise AssertionError(f"ModelPipeline ({architecture}): the architecture resolves to the model plugin "
                                 f"{resolved!r}, not {plugin!r}")
    with tempfile.TemporaryDirectory(prefix="pluginfer-model-contract-") as scratch:
        path = Path(workdir) if workdir is not None else Path(scratch)
        model = save_reference(reference_class, config, path, seed)
        return _check_engine(model, architecture, path, prompt_lengths, max_tokens, atol, seed,
                             {**ENGINE_DEFAULTS, **engine})


def save_reference(reference_class: type, config: dict[str, Any], path: Path, seed: int = 0) -> torch.nn.Module:
    """A random float32 ``reference_class`` saved (safetensors) with the demo tokenizer in ``path``; returns it."""
    from transformers import AutoTokenizer

    from pluginfer.demo.tokenizer import train_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = train_tokenizer(path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hf_config = reference_class.config_class(**{
        "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": None, **config})
    torch.manual_seed(seed)
    model = reference_class(hf_config).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    shutil.rmtree(tokenizer_dir)
    return model


def _check_engine(model: torch.nn.Module, architecture: str, path: Path, prompt_lengths: tuple[int, ...],
                  max_tokens: int, atol: float, seed: int, engine: dict[str, Any]) -> dict[str, Any]:
    from pluginfer import LLM, SamplingParams

    vocab = model.config.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in prompt_lengths]
    llm = LLM(model=str(path), **engine)
    try:
        pipeline = llm.engine.executor.worker.pipeline
        _check_members(pipeline, architecture, model.config)
        worst = 0.0
        for index, prompt in enumerate(prompts):
            ours = prefill_logits(llm, prompt)
            with torch.inference_mode():
                theirs = model(torch.tensor([prompt])).logits[0].float()
            what = f"ModelPipeline.forward + compute_logits ({architecture}, prompt {index} of {len(prompt)} tokens)"
            if ours.dtype != torch.float32 or tuple(ours.shape) != tuple(theirs.shape):
                raise AssertionError(f"{what}: logits {ours.dtype} {tuple(ours.shape)}, transformers' are float32 "
                                     f"{tuple(theirs.shape)}")
            error = (ours - theirs).abs()
            worst = max(worst, error.max().item())
            if not error.max().item() <= atol:
                position = int(error.amax(dim=-1).argmax())
                raise AssertionError(f"{what}: prefill logits differ from transformers' by {error.max().item():.3g} "
                                     f"(atol {atol}), first worst at position {position}")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
        for index, (prompt, ours) in enumerate(zip(prompts, tokens, strict=True)):
            theirs = _hf_greedy(model, prompt, max_tokens)
            if list(ours) != theirs:
                step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                raise AssertionError(f"ModelPipeline.forward ({architecture}, prompt {index}): greedy tokens diverge "
                                     f"from transformers' at token {step}: ours {list(ours)}, transformers' {theirs}")
        _check_loading_errors(pipeline, architecture)
        return {"max_logit_error": worst, "tokens": tokens}
    finally:
        llm.close()


def _check_members(pipeline: Any, architecture: str, hf_config: Any) -> None:
    if not isinstance(pipeline, ModelPipeline):
        missing = [name for name in ("can_generate", "kv_cache_spec", "bind_kv_caches", "load_weights", "forward",
                                     "compute_logits") if not hasattr(pipeline, name)]
        raise AssertionError(f"ModelPipeline.{missing[0] if missing else '?'} ({architecture}): "
                             f"{type(pipeline).__name__} does not have it")
    if pipeline.can_generate is not True:
        raise AssertionError(f"ModelPipeline.can_generate ({architecture}): True for a model loaded with its LM head, "
                             f"got {pipeline.can_generate!r}")
    spec = pipeline.kv_cache_spec()
    if not isinstance(spec, KVCacheSpec):
        raise AssertionError(f"ModelPipeline.kv_cache_spec ({architecture}): a KVCacheSpec, got {type(spec).__name__}")
    layers = getattr(hf_config, "num_hidden_layers", None)
    if layers is not None and spec.num_layers != layers:
        raise AssertionError(f"ModelPipeline.kv_cache_spec ({architecture}): {spec.num_layers} layers, the config "
                             f"has num_hidden_layers {layers}")


def _check_loading_errors(pipeline: Any, architecture: str) -> None:
    name = "model.layers.0.no_such_projection.weight"
    try:
        pipeline.load_weights(iter([(name, torch.zeros(4, 4))]))
    except KeyError as exc:
        if "no_such_projection" not in str(exc):  # a pipeline may name it after its own prefix mapping
            raise AssertionError(f"ModelPipeline.load_weights ({architecture}): the KeyError for an unexpected "
                                 f"tensor must name it ({name!r}), got {exc}") from None
    else:
        raise AssertionError(f"ModelPipeline.load_weights ({architecture}): accepted {name!r}, which matches no "
                             "parameter (KeyError naming it expected)")
    try:
        pipeline.load_weights(iter([]))
    except KeyError:
        pass
    else:
        raise AssertionError(f"ModelPipeline.load_weights ({architecture}): a checkpoint of no tensors left every "
                             "parameter unloaded without a KeyError naming them")
    try:
        pipeline.bind_kv_caches([])
    except ValueError:
        return
    raise AssertionError(f"ModelPipeline.bind_kv_caches ({architecture}): accepted 0 caches for "
                         f"{pipeline.kv_cache_spec().num_layers} layers (ValueError expected)")


def _hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prefill_logits(llm: Any, prompt: list[int]) -> torch.Tensor:
    """Float32 logits at every prompt position, through the engine's own step (the public API gives the last)."""
    from pluginfer.engine.sequence import SamplingParams, Sequence
    from pluginfer.engine.step import NewRow, StepData

    engine = llm.engine
    seq = Sequence("model-contract-probe", list(prompt), SamplingParams(temperature=0.0, max_tokens=1))
    if not (engine.block_manager.allocate_prompt(seq) and engine.block_manager.ensure_slots(seq, len(prompt))):
        raise ValueError(f"the engine has no cache blocks for a prompt of {len(prompt)} tokens: raise num_blocks")
    try:
        start = seq.num_computed_tokens
        step = StepData(token_ids=list(prompt[start:]), num_computed_tokens=[start],
                        block_size=engine.config.cache.block_size, num_new_tokens=[len(prompt) - start],
                        seq_ids=[seq.seq_id], new_rows=[NewRow(seq.seq_id, list(seq.block_table))], reset=True,
                        sampled_rows=[], extra_rows=[(0, len(prompt) - start)])
        return engine.executor.run_step(step).cpu()
    finally:
        engine.block_manager.free(seq)
