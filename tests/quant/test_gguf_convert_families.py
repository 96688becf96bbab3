"""``pluginfer convert`` of the dense families beside llama: the file transformers reads (its GGUF reader, or
gguf-py's names and dequantization) as the same model as ours, with llama.cpp's conventions."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from pluginfer import LLM
from pluginfer.cli import main
from tests.checkpoints import copy_tokenizer, greedy, hf_greedy, hf_logits, prefill_logits, random_prompts
from tests.quant.fixtures.make_gguf_fixtures import MODELS
from tests.quant.gguf_helpers import transformers_from_source

CASES = {  # the fixtures' configs (make_gguf_fixtures.py) -> the GGUF architecture written
    "llamacpp-gemma": "gemma", "llamacpp-gemma2": "gemma2", "llamacpp-gemma3": "gemma3", "llamacpp-phi2": "phi2",
    "llamacpp-phi3": "phi3", "llamacpp-phi3-longrope": "phi3", "llamacpp-stablelm": "stablelm",
    "llamacpp-glm4": "glm4",
}


@pytest.fixture(autouse=True)
def float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """As test_gguf_llamacpp.py: float32 activations, so the logits match transformers within 1e-4."""
    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")


def save_checkpoint(stem: str, out: Path, tokenizer_dir: Path) -> tuple[str, dict]:
    """The fixture's model with this tokenizer's vocabulary, its norms and biases drawn at random."""
    import transformers
    from transformers import AutoTokenizer

    architecture, config, _ = MODELS[stem]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = {**{k: v for k, v in config.items() if not k.endswith("token_id") and k != "vocab_size"},
              "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": None}
    model_cls = getattr(transformers, architecture)
    torch.manual_seed(1)
    model = model_cls(model_cls.config_class(**config)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out)
    return architecture, config


@pytest.mark.parametrize("stem", sorted(CASES))
def test_converted_file_reads_like_transformers(stem: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    architecture, config = save_checkpoint(stem, tmp_path / "hf", tiny_tokenizer_dir)
    out = tmp_path / "model.gguf"
    assert main(["convert", "--model", str(tmp_path / "hf"), "--quant", "q8_0", "--output", str(out)]) == 0
    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.architecture").contents() == CASES[stem]
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    assert types["blk.1.ffn_down.weight"] == "Q8_0" and types["token_embd.weight"] == "F16"

    oracle = transformers_from_source(out, architecture, config)
    # a float32 KV cache, as the float32 oracle's (a GGUF file's default is float16, llama.cpp's)
    llm = LLM(model=str(out), num_blocks=64, block_size=8, kv_cache_dtype="float32")
    prompt = random_prompts(config["vocab_size"], [72 if "longrope" in stem else 24], seed=5)[0]
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(oracle, prompt), atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], greedy(12))[0].outputs[0].token_ids == hf_greedy(oracle, prompt, 12)


def test_what_gguf_cannot_carry_is_refused(tmp_path: Path, tiny_tokenizer_dir: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    save_checkpoint("llamacpp-stablelm-qknorm", tmp_path / "hf", tiny_tokenizer_dir)
    out = tmp_path / "m.gguf"
    assert main(["convert", "--model", str(tmp_path / "hf"), "--quant", "q8_0", "--output", str(out)]) == 2
    assert "qk_layernorm: StableLM's per-head q/k LayerNorms cannot be written to GGUF here" in capsys.readouterr().err
    assert not out.exists()
