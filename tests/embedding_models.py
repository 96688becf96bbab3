"""Tiny random embedding checkpoints, as sentence-transformers saves them or as hub repos lay them out.

- ``qwen3``: a Qwen3 decoder saved by sentence-transformers itself (v6 format: a bare ``Qwen3Model``
  without the ``model.`` prefix or an LM head; last-token pooling, Normalize), like Qwen3-Embedding;
  config.json also says ``matryoshka_dimensions`` so ``dimensions`` can be checked.
- ``llama``: a ``LlamaForCausalLM`` checkpoint with hand-written sentence-transformers files in the
  pre-v6 format (``pooling_mode_mean_tokens``, no Normalize), as many hub repos have them.
- ``llama_cls``: the same weights with CLS pooling and Normalize.

No chat template is copied: sentence-transformers v6 renders text through one when the tokenizer has
it, and embedding inputs are embedded as given (docs/server.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

QWEN3_MATRYOSHKA = [16, 32, 64]
TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5)


def _legacy_st_files(directory: Path, pooling_flag: str, normalize: bool, hidden: int) -> None:
    """modules.json and the Pooling config as sentence-transformers before v6 wrote them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    flags = {name: name == pooling_flag for name in (
        "pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **flags, "include_prompt": True}))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))


def save_embedding_checkpoints(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """Build the three checkpoints under ``root``; returns {name: directory}."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers v6; v5 and older have them in sentence_transformers.models
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer

    from tests.checkpoints import save_hf_model

    root.mkdir(parents=True, exist_ok=True)
    qwen3_lm = root / "qwen3_lm"
    save_hf_model("Qwen3ForCausalLM", dict(TINY_DECODER, head_dim=16), qwen3_lm, tokenizer_dir, seed=1)
    (qwen3_lm / "chat_template.jinja").unlink(missing_ok=True)
    transformer = Transformer(str(qwen3_lm))
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(str(root / "qwen3"))
    config_file = root / "qwen3" / "config.json"
    config = json.loads(config_file.read_text())
    config["matryoshka_dimensions"] = QWEN3_MATRYOSHKA
    config_file.write_text(json.dumps(config))

    llama = root / "llama"
    save_hf_model("LlamaForCausalLM", TINY_DECODER, llama, tokenizer_dir, seed=2)
    (llama / "chat_template.jinja").unlink(missing_ok=True)
    hidden = TINY_DECODER["hidden_size"]
    _legacy_st_files(llama, "pooling_mode_mean_tokens", normalize=False, hidden=hidden)
    llama_cls = root / "llama_cls"
    shutil.copytree(llama, llama_cls)
    _legacy_st_files(llama_cls, "pooling_mode_cls_token", normalize=True, hidden=hidden)
    return {"qwen3": root / "qwen3", "llama": llama, "llama_cls": llama_cls}


def sentence_transformer(path: Path):  # sentence_transformers.SentenceTransformer
    """sentence-transformers' own model of a checkpoint (float32, CPU), padding with EOS (the tiny
    tokenizer has no pad token)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    model.tokenizer.pad_token = model.tokenizer.eos_token
    return model
