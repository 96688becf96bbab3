"""Tiny random encoder checkpoints (BERT, XLM-RoBERTa, ModernBERT) with an offline-trained WordPiece tokenizer.

- ``bert`` / ``xlm_roberta``: bare encoders saved by sentence-transformers (mean pooling + Normalize / CLS pooling);
- ``bert_cross`` / ``xlm_roberta_cross``: ``*ForSequenceClassification`` with one label, as sentence-transformers'
  ``CrossEncoder`` loads them; ``bert_cross_identity``: the BERT one saved by ``CrossEncoder.save`` (v6 files) with
  an Identity activation (raw logits);
- ``modernbert`` / ``modernbert_cross``: the same two kinds for ModernBERT (``save_modernbert``).
The tokenizer's specials are ``[CLS]`` 0, ``[PAD]`` 1 (RoBERTa's padding_idx), ``[SEP]`` 2; BERT's pairs are
``[CLS] a [SEP] b [SEP]`` with token type 1 on the second text, XLM-RoBERTa's all type 0 (its one token type).
"""

from __future__ import annotations

from pathlib import Path

TINY_ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=130, initializer_range=0.2, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
SPECIALS = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]


def train_wordpiece(out_dir: Path, pair_type: int) -> Path:
    """A WordPiece tokenizer trained on the demo corpus; ``pair_type``: the token type of a pair's second text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from pluginfer.demo.tokenizer import CORPUS_PATH

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=1000, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair=f"[CLS] $A [SEP] $B:{pair_type} [SEP]:{pair_type}",
        special_tokens=[("[CLS]", 0), ("[SEP]", 2)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, cls_token="[CLS]", sep_token="[SEP]",
                                      pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]", model_max_length=128,
                                      model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    return out_dir


def _save(arch: str, out: Path, tokenizer_dir: Path, seed: int, **extra: object) -> None:
    import torch
    import transformers
    from transformers import AutoTokenizer

    model_cls = getattr(transformers, arch)
    sizes = {} if arch.startswith("ModernBert") else TINY_ENCODER
    config = model_cls.config_class(vocab_size=len(AutoTokenizer.from_pretrained(str(tokenizer_dir))),
                                    pad_token_id=1, **sizes, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out)


def save_encoder_checkpoints(root: Path) -> dict[str, Path]:
    """Build the four checkpoints under ``root``; returns {name: directory}."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers v6; v5 and older have them in sentence_transformers.models
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer

    bert_tokenizer = train_wordpiece(root / "bert_tokenizer", pair_type=1)
    xlmr_tokenizer = train_wordpiece(root / "xlmr_tokenizer", pair_type=0)
    paths = {}
    for name, arch, tokenizer, extra, pooling, normalize in (
            ("bert", "BertModel", bert_tokenizer, {"type_vocab_size": 2}, "mean", True),
            ("xlm_roberta", "XLMRobertaModel", xlmr_tokenizer, {"type_vocab_size": 1}, "cls", False)):
        raw = root / f"{name}_raw"
        _save(arch, raw, tokenizer, seed=3, **extra)
        transformer = Transformer(str(raw))
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
        SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu").save(str(root / name))
        paths[name] = root / name
    for name, arch, tokenizer, extra in (
            ("bert_cross", "BertForSequenceClassification", bert_tokenizer, {"type_vocab_size": 2}),
            ("xlm_roberta_cross", "XLMRobertaForSequenceClassification", xlmr_tokenizer, {"type_vocab_size": 1})):
        _save(arch, root / name, tokenizer, seed=4, num_labels=1, **extra)
        paths[name] = root / name
    import torch
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(paths["bert_cross"]), device="cpu", activation_fn=torch.nn.Identity()).save(
        str(root / "bert_cross_identity"))
    paths["bert_cross_identity"] = root / "bert_cross_identity"
    paths.update(save_modernbert(root, bert_tokenizer))
    return paths


MODERNBERT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=128, local_attention=8, global_attn_every_n_layers=3, initializer_range=0.2,
                  cls_token_id=0, sep_token_id=2, bos_token_id=0, eos_token_id=2)


def save_modernbert(root: Path, tokenizer: Path) -> dict[str, Path]:
    """A ModernBERT embedding model (mean pooling + Normalize) and cross-encoder; a local window of 8 tokens, so
    sentences longer than it tell local layers from global ones."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer

    raw = root / "modernbert_raw"
    _save("ModernBertModel", raw, tokenizer, seed=5, **MODERNBERT)
    transformer = Transformer(str(raw))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode="mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "modernbert"))
    _save("ModernBertForSequenceClassification", root / "modernbert_cross", tokenizer, seed=6, num_labels=1,
          **MODERNBERT)
    return {"modernbert": root / "modernbert", "modernbert_cross": root / "modernbert_cross"}
