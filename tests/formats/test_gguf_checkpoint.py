"""formats/gguf/checkpoint.py: metadata -> HF config, tokenizer from the file, and the named errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch

from pluginfer import LLM
from pluginfer.cli.convert import convert_to_gguf, write_gguf
from pluginfer.engine.loader import ModelNotFoundError, iter_weights, read_hf_config, resolve_model_path
from pluginfer.formats.gguf.checkpoint import GGMLTensor, GGUFCheckpoint
from pluginfer.text.tokenizer import load_tokenizer


def load(path: Path) -> LLM:
    return LLM(model=str(path), num_blocks=16, block_size=8)


@pytest.fixture(scope="module")
def llama_gguf(tiny_llama_checkpoint: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_to_gguf(tiny_llama_checkpoint[0], tmp_path_factory.mktemp("gguf") / "tiny.gguf", "q8_0", "f32")


def rewrite(directory: Path, out: Path, edit: dict[str, object]) -> Path:
    """The checkpoint as a q8_0 GGUF with tensors replaced (a tensor / GGMLTensor) or dropped (None)."""
    def weights() -> Iterator[tuple[str, object]]:
        for name, tensor in iter_weights(directory):
            replacement = edit.get(name, tensor)
            if replacement is not None:
                yield name, replacement
    return write_gguf(out, read_hf_config(directory), load_tokenizer(directory), weights(), "q8_0", "f32")


def test_metadata_becomes_the_hf_config(llama_gguf: Path, tiny_llama_checkpoint: tuple[Path, object]) -> None:
    hf = read_hf_config(tiny_llama_checkpoint[0])
    config = read_hf_config(llama_gguf)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id",
                "tie_word_embeddings"):
        assert config[key] == hf[key], key
    assert config["head_dim"] == hf["hidden_size"] // hf["num_attention_heads"]
    assert config["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"])
    assert config["rope_theta"] == pytest.approx(hf.get("rope_theta", hf.get("rope_parameters", {}).get("rope_theta")))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["quantization_config"] == {"quant_method": "gguf"}
    assert resolve_model_path(str(llama_gguf)) == llama_gguf


def test_tokenizer_and_chat_template_come_from_the_file(llama_gguf: Path, tiny_tokenizer_dir: Path) -> None:
    ours, reference = load_tokenizer(llama_gguf), load_tokenizer(tiny_tokenizer_dir)
    text = "The engine reads a file.\n\n  Twice, <|im_start|>user 42 times é"
    assert ours.encode(text) == reference.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    llm = load(llama_gguf)
    assert llm.engine.eos_token_ids == {reference.eos_token_id}
    assert llm.generate("The engine", None)[0].outputs[0].token_ids  # text prompts go through the file's tokenizer


def test_unknown_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = ("deepseek2, gemma, gemma2, gemma3, glm4, llama, phi2, phi3, qwen2, qwen2moe, qwen3, qwen3moe, "
                 "stablelm")
    with pytest.raises(ValueError, match=rf"gguf architecture 'gpt2' is not supported by any model plugin "
                                         rf"\(supported: {supported}\)"):
        load(path)


def test_missing_tensor_is_named(tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> None:
    path = rewrite(tiny_llama_checkpoint[0], tmp_path / "missing.gguf", {"model.layers.1.mlp.down_proj.weight": None})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load(path)


@pytest.mark.parametrize("quantized", [False, True])
def test_shape_that_does_not_match_the_config_is_named(quantized: bool, tiny_llama_checkpoint: tuple[Path, object],
                                                       tmp_path: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    directory, model = tiny_llama_checkpoint
    short = model.state_dict()[name][:96]
    if quantized:
        blocks = torch.from_numpy(gguf.quants.quantize(short.numpy(), gguf.GGMLQuantizationType.Q8_0))
        short = GGMLTensor(blocks, gguf.GGMLQuantizationType.Q8_0, short.shape, "blk.0.ffn_up.weight")
    path = rewrite(directory, tmp_path / "short.gguf", {name: short})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*\(96, 64\) does not match "
                                         r"expected \(128, 64\)"):
        load(path)


def test_unsupported_tensor_type_is_named(tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    iq4_nl = gguf.GGMLQuantizationType.IQ4_NL
    raw = torch.zeros(64, 64 // 32 * gguf.GGML_QUANT_SIZES[iq4_nl][1], dtype=torch.uint8)
    path = rewrite(tiny_llama_checkpoint[0], tmp_path / "iq4.gguf",
                   {name: GGMLTensor(raw, iq4_nl, torch.Size([64, 64]), "blk.0.attn_output.weight")})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight'.*IQ4_NL is not supported"):
        load(path)


def copy_gguf(source: Path, out: Path, fields: dict[str, int] = {}, tensors: dict[str, object] = {}) -> Path:  # noqa: B006
    """``source`` rewritten with its metadata and tensors as they are, plus uint32 ``fields`` and ``tensors``."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, value in fields.items():
        writer.add_uint32(key, value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tuple(tensor.data.shape), raw_dtype=tensor.tensor_type)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_tensor_without_counterpart_is_named(llama_gguf: Path, tmp_path: Path) -> None:
    path = copy_gguf(llama_gguf, tmp_path / "extra.gguf", tensors={"blk.0.attn_sinks.weight": torch.zeros(4).numpy()})
    assert GGUFCheckpoint(path).hf_config()["hidden_size"] == 64  # the copy is a valid file
    with pytest.raises(KeyError, match=r"'blk\.0\.attn_sinks\.weight' has no counterpart"):
        load(path)


def test_end_of_turn_token_also_stops(llama_gguf: Path, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    im_end = load_tokenizer(tiny_tokenizer_dir).convert_tokens_to_ids("<|im_end|>")
    path = copy_gguf(llama_gguf, tmp_path / "eot.gguf", fields={"tokenizer.ggml.eot_token_id": im_end})
    eos = read_hf_config(llama_gguf)["eos_token_id"]
    assert read_hf_config(path)["eos_token_id"] == [eos, im_end]
    assert load(path).engine.eos_token_ids == {eos, im_end}


def test_generate_command_reads_a_gguf_file(llama_gguf: Path, capsys: pytest.CaptureFixture) -> None:
    from pluginfer.cli import main

    assert main(["generate", "--model", str(llama_gguf), "--prompt", "The engine", "--chat-template",
                 "--max-tokens", "4", "--ignore-eos", "--temperature", "0", "--num-blocks", "16"]) == 0
    assert capsys.readouterr().out.strip()


def test_a_file_that_is_not_gguf_is_still_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    (tmp_path / "broken.gguf").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load(tmp_path / "broken.gguf")


def test_an_engine_parses_the_file_once_and_times_its_start_up(llama_gguf: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The config and the weights come from one reading of the file's header, by formats/gguf/reader.py; the
    tokenizer (formats/gguf/tokenizer.py) reads the metadata alone (``tensors=False``); gguf-py's reader is not
    used; each start-up phase is timed."""
    from pluginfer.formats.gguf import reader as gguf_reader

    monkeypatch.setenv("PLUGINFER_CACHE", str(tmp_path / "cache"))
    opened: list[tuple[str, Path, bool]] = []

    def counting(name: str, reader: type) -> object:
        def open_file(path: Path, *args: object, **kwargs: object) -> object:
            opened.append((name, Path(path), bool(kwargs.get("tensors", True))))
            return reader(path, *args, **kwargs)
        return open_file

    monkeypatch.setattr(gguf, "GGUFReader", counting("gguf-py", gguf.GGUFReader))
    monkeypatch.setattr(gguf_reader, "GGUFFile", counting("ours", gguf_reader.GGUFFile))
    llm = load(llama_gguf)
    # (the tokenizer's reading, in its thread beside the weights' load, may come first)
    assert sorted(opened, key=lambda item: not item[2]) == [("ours", llama_gguf, True), ("ours", llama_gguf, False)]
    assert llm.generate("The engine", None)[0].outputs[0].token_ids
    times = llm.engine.startup_times
    assert set(times) - {"graphs"} == {"config", "build", "load", "repack", "cache", "tokenizer"}
    assert all(seconds >= 0 for seconds in times.values())


def edited_header(source: Path, out: Path, tensor: str, part: int, value: int) -> Path:
    """A copy of ``source`` with one field of ``tensor``'s header entry overwritten in place (parts: name
    length, name, dimension count, dimensions, type, offset)."""
    out.write_bytes(source.read_bytes())
    reader = gguf.GGUFReader(out, "r+")
    entry = next(t for t in reader.tensors if t.name == tensor).field
    entry.parts[part][0] = value
    reader.data.flush()
    del reader
    return out


@pytest.mark.parametrize("case", ["truncated", "offset", "type", "blocks"])
def test_a_malformed_tensor_entry_is_named_before_anything_reads_it(case: str, llama_gguf: Path,
                                                                    tmp_path: Path) -> None:
    """A header that no data can satisfy: a ValueError naming the tensor and what is wrong, at load (gguf-py's
    own reader stops on these with numpy's reshape error, naming nothing); no kernel ever sees the bytes."""
    last = max(gguf.GGUFReader(llama_gguf).tensors, key=lambda t: t.data_offset)
    path = tmp_path / f"{case}.gguf"
    if case == "truncated":
        path.write_bytes(llama_gguf.read_bytes()[:-100])
        name, problem = last.name, r"takes \d+ bytes from offset \d+, past the end of the file \(\d+ bytes\)"
    elif case == "offset":
        edited_header(llama_gguf, path, "blk.0.attn_q.weight", 5, 1 << 40)
        name, problem = "blk.0.attn_q.weight", r"Q8_0 data of GGML shape \[64, 64\] takes 4352 bytes from offset"
    elif case == "type":
        edited_header(llama_gguf, path, "blk.1.ffn_up.weight", 4, 99)
        name, problem = "blk.1.ffn_up.weight", "has an unknown GGML type 99 \\(known: F32, F16, Q4_0"
    else:
        edited_header(llama_gguf, path, "blk.0.ffn_down.weight", 3, 100)
        name, problem = "blk.0.ffn_down.weight", "rows of 100 weights are not whole Q8_0 blocks of 32"
    with pytest.raises(ValueError) as gguf_py:
        gguf.GGUFReader(path)
    assert name not in str(gguf_py.value)
    pattern = rf"{path.name}: GGUF tensor '{name}'.*{problem}"
    with pytest.raises(ValueError, match=pattern):
        GGUFCheckpoint(path)
    with pytest.raises(ValueError, match=pattern):
        load(path)


def with_field(source: Path, out: Path, name: str, value: list[str]) -> Path:
    """``source`` rewritten with the string array ``name`` replaced by ``value``."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")) or field.name == name:
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_key_value(name, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tuple(tensor.data.shape), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def tokenizer_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "pluginfer-tokenizer"]


def test_a_tokenizer_that_fails_beside_the_weights_fails_the_start_cleanly(llama_gguf: Path, tmp_path: Path) -> None:
    """The tokenizer is built in a thread while the weights load: its error is still load_tokenizer's one line,
    raised by the engine's start, and the thread is over."""
    path = with_field(llama_gguf, tmp_path / "merges.gguf", "tokenizer.ggml.merges", ["zq_not_a_token xq_neither"])
    assert GGUFCheckpoint(path).hf_config()["hidden_size"] == 64  # the weights and the config are fine
    with pytest.raises(ValueError) as raised:
        load(path)
    message = str(raised.value)
    assert message.startswith(f"cannot load a tokenizer from {path}: ") and "\n" not in message
    with pytest.raises(ValueError) as alone:
        load_tokenizer(path)
    assert str(alone.value) == message
    assert not tokenizer_threads()


def test_a_model_that_fails_to_load_is_the_error_reported_and_the_tokenizer_thread_ends(llama_gguf: Path,
                                                                                       tmp_path: Path) -> None:
    path = copy_gguf(llama_gguf, tmp_path / "extra.gguf", tensors={"blk.0.attn_sinks.weight": torch.zeros(4).numpy()})
    with pytest.raises(KeyError, match=r"'blk\.0\.attn_sinks\.weight' has no counterpart"):
        load(path)
    assert not tokenizer_threads()
