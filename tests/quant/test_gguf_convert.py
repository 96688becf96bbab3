"""``pluginfer convert``: the file gguf-py reads, that generates like the in-situ quantized HF checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from pluginfer import LLM
from pluginfer.cli import build_parser, main
from tests.checkpoints import greedy, prefill_logits, random_prompts, save_hf_model


def load(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, **kwargs)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """Rows of 256 weights, as K-quant blocks need."""
    out = tmp_path_factory.mktemp("wide_llama")
    save_hf_model("LlamaForCausalLM", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                           initializer_range=0.05, rms_norm_eps=1e-5), out, tiny_tokenizer_dir)
    return out


def test_convert_is_listed_in_help() -> None:
    assert "convert" in build_parser().format_help()


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q5_1", "q4_k", "q6_k"])
def test_converted_file_generates_like_the_in_situ_quantized_checkpoint(
        quant: str, tiny_llama_checkpoint: tuple[Path, object], wide_llama: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    directory = wide_llama if quant.endswith("_k") else tiny_llama_checkpoint[0]
    out = tmp_path / f"model-{quant}.gguf"
    assert main(["convert", "--model", str(directory), "--quant", quant, "--output", str(out),
                 "--embedding-type", "f32"]) == 0
    assert "wrote" in capsys.readouterr().out
    # gguf-py reads it: linear weights in the asked type, norms and the embedding F32, q/k as llama.cpp.
    reader = gguf.GGUFReader(out)
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == quant.upper()
    assert types["blk.0.attn_norm.weight"] == types["token_embd.weight"] == types["output.weight"] == "F32"
    assert reader.get_field("general.architecture").contents() == "llama"
    assert reader.get_field("tokenizer.ggml.model").contents() == "gpt2"
    assert reader.get_field("tokenizer.chat_template").contents().startswith("{%- for message in messages")

    prompt = random_prompts(200, [24], seed=8)[0]
    from_file, in_situ = load(out), load(directory, quant=quant)
    torch.testing.assert_close(prefill_logits(from_file, prompt), prefill_logits(in_situ, prompt), atol=1e-4, rtol=1e-4)
    assert from_file.generate([prompt], greedy(12))[0].outputs[0].token_ids == \
        in_situ.generate([prompt], greedy(12))[0].outputs[0].token_ids


def test_convert_refuses_what_it_cannot_write(tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "falcon"
    shutil.copytree(tiny_llama_checkpoint[0], source)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (source / "config.json").write_text(json.dumps(config))
    assert main(["convert", "--model", str(source), "--quant", "q8_0", "--output", str(tmp_path / "x.gguf")]) == 2
    assert "cannot be converted (supported: LlamaForCausalLM" in capsys.readouterr().err


def test_convert_builds_and_reads_the_demo_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    """``--model demo`` is the built demo checkpoint, as for every other command (it was read as ./demo)."""
    monkeypatch.setenv("PLUGINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # no ./demo here
    out = tmp_path / "demo-q8_0.gguf"
    assert main(["convert", "--model", "demo", "--quant", "q8_0", "--output", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.architecture").contents() == "llama"
    assert {t.tensor_type.name for t in reader.tensors if t.name.endswith("attn_q.weight")} == {"Q8_0"}
    assert (tmp_path / "cache" / "demo-v1" / "config.json").is_file()


def test_convert_prints_a_line_per_tensor_with_progress(wide_llama: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "model-q4_k.gguf"
    assert main(["convert", "--model", str(wide_llama), "--quant", "q4_k", "--output", str(out), "--progress"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("[")]  # (transformers may warn too)
    reader = gguf.GGUFReader(out)
    written = {t.name: t.tensor_type.name for t in reader.tensors}
    assert len(lines) == len(written) == 2 * 9 + 3  # 9 per layer, the embedding, the final norm, the LM head
    for index, line in enumerate(lines, 1):
        assert line.startswith(f"[{index:>2}/{len(written)}] ")
        name, qtype, shape, seconds, unit = line.partition("] ")[2].split()
        assert written[name] == qtype and unit == "s" and float(seconds) >= 0
    by_name = {fields[0]: fields[1:3] for fields in (line.partition("] ")[2].split() for line in lines)}
    assert by_name["blk.0.attn_q.weight"] == ["Q4_K", "256x256"]
    assert by_name["blk.1.ffn_down.weight"] == ["Q4_K", "256x512"]  # Hugging Face's [out, in]
    assert by_name["token_embd.weight"][0] == "F16" and by_name["output_norm.weight"] == ["F32", "256"]
    assert "wrote" in captured.out and "wrote" not in captured.err


@pytest.mark.parametrize("flag", [["--no-progress"], []], ids=["no-progress", "not-a-terminal"])
def test_convert_is_quiet_without_progress(flag: list[str], tiny_llama_checkpoint: tuple[Path, object],
                                           tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Quiet with --no-progress, and by default when stderr is not a terminal (here: pytest's capture)."""
    out = tmp_path / "model.gguf"
    assert main(["convert", "--model", str(tiny_llama_checkpoint[0]), "--quant", "q8_0", "--output", str(out),
                 *flag]) == 0
    assert capsys.readouterr().err == ""
