"""``pluginfer convert``: a Hugging Face checkpoint (llama, qwen2/3, gemma 1-3, phi-2/3, stablelm, glm4, DeepSeek-V2/V3,
and the experts of Mixtral, Qwen2-MoE and Qwen3-MoE merged per layer as llama.cpp merges them) to a quantized ``.gguf``
file.

The file follows llama.cpp's ``convert_hf_to_gguf.py``: the same metadata keys, a gpt2-style BPE
vocabulary with merges and token types, the chat template, llama's q/k rows permuted, 1-D
tensors in F32; the other families' keys and tensor changes (Gemma's norms stored ``1 + w``) come from
their GGUF module's ``write_hparams`` / ``tensor_for_file`` / ``weights_for_file`` / ``write_sentencepiece_extras``
(``pluginfer/models/gguf_*.py``). Linear weights take the requested type, quantized by ``quant/ggml_blocks.py``
(F16 where a row does not divide into its blocks, as llama.cpp falls back); the embedding and the
LM head take ``--embedding-type``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # torch is imported where a conversion runs: `pluginfer serve` starts its engine before torch loads
    import torch
    from gguf import GGMLQuantizationType

# HF architecture -> GGUF general.architecture.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                 "PhiForCausalLM": "phi2", "Phi3ForCausalLM": "phi3", "StableLmForCausalLM": "stablelm",
                 "Glm4ForCausalLM": "glm4", "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
                 "Qwen3MoeForCausalLM": "qwen3moe", "DeepseekV2ForCausalLM": "deepseek2",
                 "DeepseekV3ForCausalLM": "deepseek2"}
# GGUF architecture -> the module writing its own keys (``write_hparams``) and tensor changes (``tensor_for_file``).
_FAMILY_WRITERS = {**dict.fromkeys(("gemma", "gemma2", "gemma3"), "pluginfer.models.gguf_gemma"),
                   **dict.fromkeys(("phi2", "phi3"), "pluginfer.models.gguf_phi"),
                   "stablelm": "pluginfer.models.gguf_stablelm", "glm4": "pluginfer.models.gguf_glm4",
                   "deepseek2": "pluginfer.models.gguf_deepseek"}
# Families whose writer gives the attention's head and key/value lengths itself (a latent cache's)
_OWN_ATTENTION_SIZES = ("deepseek2",)
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k")
# Our type names -> llama.cpp's general.file_type.
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
               "q4_k": "MOSTLY_Q4_K_M", "q6_k": "MOSTLY_Q6_K"}


def register(commands: argparse._SubParsersAction, add_engine_arguments: Callable) -> None:
    convert = commands.add_parser("convert", help="write a Hugging Face checkpoint as a quantized .gguf file")
    convert.add_argument("--model", required=True, help="Hugging Face checkpoint directory, or demo")
    convert.add_argument("--quant", required=True, choices=TYPES, help="type of the linear layers' weights")
    convert.add_argument("--output", required=True, help="the .gguf file to write")
    convert.add_argument("--embedding-type", default="f16", choices=TYPES,
                         help="type of the embedding table and LM head (default f16)")
    convert.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                         help="a line per tensor on stderr (default: when stderr is a terminal)")
    convert.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    model_dir = Path(args.model)
    if args.model == "demo":  # as every other command: the built demo checkpoint
        from pluginfer.demo.model import ensure_demo_model

        model_dir = ensure_demo_model()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    path = convert_to_gguf(model_dir, Path(args.output), args.quant, args.embedding_type,
                           progress=print_progress if show else None)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _qtype(name: str) -> GGMLQuantizationType:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name.upper()]


# Called after each tensor is written: (index from 1, tensor count or None, GGUF name, type name, shape, seconds).
Progress = Callable[[int, int | None, str, str, tuple[int, ...], float], None]


def print_progress(index: int, total: int | None, name: str, qtype: str, shape: tuple[int, ...],
                   seconds: float) -> None:
    """``[ 3/22] blk.0.attn_q.weight  Q4_K  256x256  0.41 s`` on stderr."""
    count = "?" if total is None else str(total)
    print(f"[{index:>{len(count)}}/{count}] {name}  {qtype}  {'x'.join(map(str, shape))}  {seconds:.2f} s",
          file=sys.stderr, flush=True)


def convert_to_gguf(model_dir: Path, output: Path, quant: str, embedding_type: str = "f16",
                    progress: Progress | None = None) -> Path:
    from pluginfer.engine.loader import iter_weights, read_hf_config
    from pluginfer.text.tokenizer import load_tokenizer

    config = read_hf_config(model_dir)
    if config.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized ({config['quantization_config'].get('quant_method')}); "
                         f"convert reads floating-point checkpoints")
    from pluginfer.models.gguf_moe import merged_name

    names = {merged_name(name) for name in tensor_names(model_dir) if not _skipped(name, config)}
    total = len(names) + sum(name.endswith(".kv_b_proj.weight") for name in names)  # deepseek2: k_b and v_b
    # a SentencePiece model is read from its file (as llama.cpp's converter does), the rest through the tokenizer
    tokenizer = None if (model_dir / "tokenizer.model").is_file() else load_tokenizer(model_dir)
    return write_gguf(output, config, tokenizer, iter_weights(model_dir, progress=False),
                      quant, embedding_type, progress=progress, total=total, tokenizer_dir=model_dir)


def tensor_names(model_dir: Path) -> list[str]:
    """Every tensor name of the checkpoint's safetensors files (their headers only)."""
    from safetensors import safe_open

    from pluginfer.formats.safetensors import safetensors_files

    names = []
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            names.extend(handle.keys())
    return names


def _skipped(hf_name: str, config: dict) -> bool:
    """Tensors the file does not carry: rope tables, and the LM head when tied to the embedding."""
    return "rotary_emb.inv_freq" in hf_name or (bool(config.get("tie_word_embeddings")) and hf_name == "lm_head.weight")


def write_gguf(output: Path, config: dict, tokenizer: object, weights: Iterable[tuple[str, object]],
               quant: str, embedding_type: str = "f16", types: dict[str, str] | None = None,
               progress: Progress | None = None, total: int | None = None, tokenizer_dir: Path | None = None) -> Path:
    """Write (HF name, tensor) pairs as llama.cpp would; ``types``: a type per HF name, overriding ``quant``.
    ``tokenizer_dir`` with a ``tokenizer.model``: its SentencePiece vocabulary (``tokenizer`` may then be None).

    A ``GGMLTensor`` (already in blocks) is written as it is, after the q/k row permutation. ``progress`` is
    called after each tensor written, with ``total`` (the count of tensors written, if known).
    """
    import gguf

    from pluginfer.formats.gguf.checkpoint import GGMLTensor
    from pluginfer.models import gguf_moe
    from pluginfer.models.gguf_llama import permute_rows

    names = [a for a in config.get("architectures") or [] if a in ARCHITECTURES]
    if not names:
        raise ValueError(f"architectures {config.get('architectures')} cannot be converted "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES[names[0]]
    writer = gguf.GGUFWriter(str(output), arch)
    family = importlib.import_module(_FAMILY_WRITERS[arch]) if arch in _FAMILY_WRITERS else None
    _write_sizes(writer, config, gguf.LlamaFileType[_FILE_TYPES[quant]], attention=arch not in _OWN_ATTENTION_SIZES)
    if family is None:
        _write_llama_hparams(writer, config)
    else:
        family.write_hparams(writer, config)
    if names[0] in gguf_moe.WRITTEN_ARCHITECTURES:  # experts merged per layer and projection, routers in F32
        gguf_moe.write_hparams(writer, config)
        weights = gguf_moe.merge_experts(weights, int(config.get("num_local_experts") or config["num_experts"]))
    for_file = getattr(family, "weights_for_file", None)
    if for_file is not None:  # tensors renamed, split or merged as the family's files hold them
        weights = for_file(weights, config)
    to_file = getattr(family, "tensor_for_file", None)
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.model").is_file():
        tokens = _write_sentencepiece_vocab(writer, tokenizer_dir, config)
        extras = getattr(family, "write_sentencepiece_extras", None)
        if extras is not None:  # a family's own keys beside such a vocabulary (Gemma's)
            extras(writer, arch, tokens)
    else:
        _write_tokenizer(writer, tokenizer, int(config["vocab_size"]))
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        int(config["num_hidden_layers"]))
    heads = {"q_proj": config["num_attention_heads"],
             "k_proj": config.get("num_key_value_heads") or config["num_attention_heads"]}
    index = 0
    for hf_name, tensor in weights:
        if _skipped(hf_name, config):
            continue
        index, started = index + 1, time.perf_counter()
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"tensor {hf_name!r} has no GGUF name for {arch}")
        projection = hf_name.split(".")[-2]
        if isinstance(tensor, GGMLTensor):
            raw = tensor.raw
            if arch == "llama" and projection in heads:
                raw = permute_rows(raw, heads[projection])
            writer.add_tensor(gguf_name, raw.numpy(), raw_shape=tuple(raw.shape), raw_dtype=tensor.qtype)
            written, shape = tensor.qtype, tuple(tensor.shape)
        else:
            tensor = tensor.float() if to_file is None else to_file(hf_name, tensor.float())
            if arch == "llama" and projection in heads:
                tensor = permute_rows(tensor, heads[projection])
            wanted = embedding_type if hf_name in ("model.embed_tokens.weight", "lm_head.weight") else quant
            if hf_name.endswith(gguf_moe.ROUTERS):  # as llama.cpp's converter: the routers stay F32
                wanted = "f32"
            written = _add_tensor(writer, gguf_name, tensor, _qtype((types or {}).get(hf_name, wanted)))
            shape = tuple(tensor.shape)
            if hf_name == "model.embed_tokens.weight" and config.get("tie_word_embeddings") \
                    and arch in gguf_moe.HEAD_REQUIRED:
                _add_tensor(writer, "output.weight", tensor, written)
        if progress is not None:
            progress(index, total, gguf_name, written.name, shape, time.perf_counter() - started)
    output.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return output


def _add_tensor(writer: object, name: str, tensor: torch.Tensor, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """Add one tensor; returns the type it was written in."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    if tensor.dim() == 1 or qtype == T.F32:  # norms and biases stay F32, as llama.cpp writes them
        writer.add_tensor(name, tensor.numpy().astype(np.float32))
        return T.F32
    if tensor.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        # llama.cpp's fallback for rows that do not divide into blocks
        qtype = T.F16
    if qtype == T.F16:
        writer.add_tensor(name, tensor.numpy().astype(np.float16))
        return T.F16
    from pluginfer.quant.ggml_quantize import quantize

    # merged experts [experts, rows, cols]: each row quantized on its own, as a 2-D weight's
    blocks = quantize(tensor.reshape(-1, tensor.shape[-1]), qtype, name=name)
    blocks = blocks.reshape(*tensor.shape[:-1], blocks.shape[-1]).numpy()
    writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    return qtype


# YaRN parameters a GGUF file does not carry, with the values that leave them out (transformers' defaults).
_YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "attention_factor": None, "mscale": None, "mscale_all_dim": None,
                  "truncate": True}


def _write_sizes(writer: object, config: dict, file_type: object, attention: bool = True) -> None:
    """The keys every family's file has (``attention``: with the head's KV count and key/value lengths)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(config.get("_name_or_path") or "pluginfer-convert")
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    if attention:
        writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)


def _write_llama_hparams(writer: object, config: dict) -> None:
    """Norm epsilon, rope and sliding window of the llama/qwen families."""
    import gguf

    from pluginfer.layers.rotary import rope_parameters

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    theta, scaling = rope_parameters(config)
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(head_dim)
    if scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif scaling["rope_type"] == "yarn":
        from pluginfer.layers.rotary import yarn_factor, yarn_scaling

        scaling = yarn_scaling(config)
        changed = [f"{key}={scaling[key]!r}" for key, default in _YARN_DEFAULTS.items()
                   if scaling.get(key) is not None and scaling[key] != default]
        if changed:
            # GGUF readers (ours, llama.cpp) take factor and original context only
            raise ValueError(f"rope_scaling: yarn with {', '.join(changed)} cannot be written to GGUF here "
                             f"(only factor and original_max_position_embeddings are carried)")
        factor, original = yarn_factor(scaling, int(config.get("max_position_embeddings") or 2048))
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(original)
    elif scaling["rope_type"] == "llama3":
        # as llama.cpp: per-frequency divisors in a rope_freqs tensor
        from pluginfer.models.gguf_llama import llama3_rope_factors

        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(theta, head_dim, scaling).numpy())
    elif scaling["rope_type"] != "default":
        raise ValueError(f"rope scaling {scaling['rope_type']!r} cannot be written to GGUF here "
                         f"(supported: linear, yarn, llama3)")
    if config.get("sliding_window") and ARCHITECTURES[config["architectures"][0]] == "llama":
        writer.add_sliding_window(int(config["sliding_window"]))


def _write_tokenizer(writer: object, tokenizer: object, vocab_size: int) -> None:
    """A byte-level BPE vocabulary as llama.cpp's ``_set_vocab_gpt2`` writes it."""
    import gguf

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(state.get("pre_tokenizer")):
        kind = model.get("type") if model.get("type") != "BPE" else "a BPE without a byte-level pre-tokenizer"
        raise ValueError(f"convert writes byte-level BPE tokenizers, or SentencePiece ones from a tokenizer.model "
                         f"beside the weights; this one is {kind}")
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = {token.content: token.special for token in tokenizer.added_tokens_decoder.values()}
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            kind = gguf.TokenType.NORMAL
            if token in added:
                kind = gguf.TokenType.CONTROL if added[token] else gguf.TokenType.USER_DEFINED
            types.append(kind)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attribute, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if getattr(tokenizer, attribute, None) is not None:
            add(getattr(tokenizer, attribute))
    writer.add_add_bos_token(False)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def _write_sentencepiece_vocab(writer: object, model_dir: Path, config: dict) -> list[str]:
    """``tokenizer.model``'s vocabulary as llama.cpp's ``_set_vocab_sentencepiece`` writes it: each piece with its
    score and type (user-defined pieces as normal ones), the ids past the model up to ``vocab_size`` as ``[PAD<i>]``
    (unused), the added tokens of ``added_tokens.json`` / ``tokenizer_config.json`` over them (control when special),
    the special ids of ``config.json``, ``tokenizer_config.json``'s BOS/EOS flags and chat template. The tokens."""
    from pluginfer.text import sentencepiece_model as sp

    pieces = sp.read_pieces(model_dir / "tokenizer.model")
    vocab_size = int(config["vocab_size"])
    tokens = [f"[PAD{index}]" for index in range(vocab_size)]
    scores, types = [-10000.0] * vocab_size, [sp.UNUSED] * vocab_size
    for index, piece in enumerate(pieces[:vocab_size]):
        tokens[index], scores[index] = piece.text, piece.score
        types[index] = piece.type if piece.type in (sp.UNKNOWN, sp.CONTROL, sp.UNUSED, sp.BYTE) else sp.NORMAL
    added = model_dir / "added_tokens.json"
    for text, index in (json.loads(added.read_text()) if added.is_file() else {}).items():
        if index < vocab_size:
            tokens[index], scores[index], types[index] = text, -1000.0, sp.USER_DEFINED
    settings_file = model_dir / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    for index, entry in ((int(key), value) for key, value in settings.get("added_tokens_decoder", {}).items()):
        if index >= vocab_size:
            continue
        text = entry["content"]
        special = entry.get("special") or text in ("<pad>", "<mask>") or (text.startswith("<|") and text.endswith("|>"))
        tokens[index] = text if special else text.replace("\u2581", " ")
        scores[index], types[index] = -1000.0, sp.CONTROL if special else sp.USER_DEFINED
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = config.get(key)
        if isinstance(value, list):  # several end tokens: the first, as llama.cpp's converter takes
            value = value[0] if value else None
        if value is not None and 0 <= int(value) < vocab_size:
            add(int(value))
    for key, add in (("add_bos_token", writer.add_add_bos_token), ("add_eos_token", writer.add_add_eos_token)):
        if isinstance(settings.get(key), bool):
            add(settings[key])
    template = model_dir / "chat_template.jinja"  # where transformers 4.50+ saves it
    if isinstance(settings.get("chat_template"), str):
        writer.add_chat_template(settings["chat_template"])
    elif template.is_file():
        writer.add_chat_template(template.read_text())
    return tokens
