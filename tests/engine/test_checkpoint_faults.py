"""Truncated, corrupted and unsafe checkpoints fail at load with one line naming the file and the problem.

The weights are read before the KV cache is taken (``executor.start_rank``: config, build, load, then the
cache), and a missing tokenizer is found before the weights are read. Pickle weights are refused unless
``allow_pickle``, and then read with ``torch.load(weights_only=True)``, which runs no code.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pluginfer.engine.engine import LLMEngine
from pluginfer.engine.sequence import SamplingParams
from tests.server.conftest import server_config


def _copy(tiny_llama_checkpoint, tmp_path: Path, name: str = "ckpt") -> Path:
    target = tmp_path / name
    shutil.copytree(tiny_llama_checkpoint[0], target)
    return target


def _weights(path: Path) -> Path:
    return next(path.glob("*.safetensors"))


def _truncate(path: Path) -> str:
    file = _weights(path)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return "model.safetensors is not a readable safetensors file"


def _bad_header(path: Path) -> str:
    file = _weights(path)
    data = bytearray(file.read_bytes())
    data[8:20] = b"not a header"
    file.write_bytes(bytes(data))
    return "model.safetensors is not a readable safetensors file (Error while deserializing header: invalid JSON"


def _two_bytes(path: Path) -> str:
    _weights(path).write_bytes(b"\x01\x02")
    return "header too small"


def _missing_shard(path: Path) -> str:
    with safe_open(str(_weights(path)), framework="pt") as handle:
        names = list(handle.keys())
    weight_map = {name: ("model.safetensors" if i % 2 else "model-00002-of-00002.safetensors")
                  for i, name in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return "model.safetensors.index.json names shards that are missing: model-00002-of-00002.safetensors"


def _bad_index(path: Path) -> str:
    (path / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    return "model.safetensors.index.json is not valid JSON"


def _bad_config(path: Path) -> str:
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    return "config.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 41"


def _bad_config_value(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = "many"
    (path / "config.json").write_text(json.dumps(config))
    return "num_hidden_layers"


def _no_tokenizer(path: Path) -> str:
    for file in path.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            file.unlink()
    return "has no tokenizer (none of tokenizer.json"


def _pickle_only(path: Path) -> str:
    torch.save(load_file(_weights(path)), path / "pytorch_model.bin")
    _weights(path).unlink()
    return "holds only pickle weights (pytorch_model.bin), which can run code when loaded"


@pytest.mark.parametrize("corrupt", [_truncate, _bad_header, _two_bytes, _missing_shard, _bad_index, _bad_config,
                                     _bad_config_value, _no_tokenizer, _pickle_only])
def test_a_broken_checkpoint_is_one_line_naming_the_file(tiny_llama_checkpoint, tmp_path, corrupt):
    path = _copy(tiny_llama_checkpoint, tmp_path)
    expected = corrupt(path)
    with pytest.raises((ValueError, FileNotFoundError)) as caught:  # the CLI prints these in one line
        LLMEngine(server_config(path))
    message = str(caught.value)
    assert "\n" not in message and expected in message, message


def _gguf(tiny_llama_checkpoint, tmp_path: Path) -> Path:
    out = tmp_path / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "pluginfer", "convert", "--model", str(tiny_llama_checkpoint[0]),
                    "--quant", "f32", "--output", str(out), "--no-progress"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_checkpoint, tmp_path_factory) -> Path:
    return _gguf(tiny_llama_checkpoint, tmp_path_factory.mktemp("gguf"))


def _tensor_offset_moved(data: bytes, gguf_path: Path) -> bytes:
    """The last tensor's data offset moved 1 GB past the end of the file."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    last = reader.tensors[-1]
    name = last.name.encode()
    position = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    dims = struct.unpack_from("<I", data, position)[0]
    position += 4 + 8 * dims + 4
    offset = struct.unpack_from("<Q", data, position)[0]
    return data[:position] + struct.pack("<Q", offset + 10**9) + data[position + 8:]


@pytest.mark.parametrize(("corruption", "expected"), [
    ("magic", "is not a readable GGUF file: ValueError: GGUF magic invalid"),
    ("version", "is not a readable GGUF file: ValueError: Sorry, file appears to be version 99"),
    ("truncated", "past the end of the file"),
    ("header_only", "is not a readable GGUF file"),
    ("tensor_offset", "past the end of the file"),
])
def test_a_broken_gguf_file_is_one_line_naming_it(tiny_gguf, tiny_llama_checkpoint, tmp_path, corruption, expected):
    data = tiny_gguf.read_bytes()
    broken = {"magic": lambda: b"XXXX" + data[4:],
              "version": lambda: data[:4] + struct.pack("<I", 99) + data[8:],
              "truncated": lambda: data[: len(data) * 2 // 3],
              "header_only": lambda: data[:200],
              "tensor_offset": lambda: _tensor_offset_moved(data, tiny_gguf)}[corruption]()
    path = tmp_path / f"{corruption}.gguf"
    path.write_bytes(broken)
    with pytest.raises(ValueError) as caught:
        LLMEngine(server_config(path, tokenizer=str(tiny_llama_checkpoint[0])))
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and expected in message, message


def test_the_cli_prints_one_line_and_exits_2(tiny_llama_checkpoint, tmp_path):
    path = _copy(tiny_llama_checkpoint, tmp_path)
    _truncate(path)
    result = subprocess.run([sys.executable, "-m", "pluginfer", "generate", "--model", str(path), "--prompt", "hi",
                             "--max-tokens", "2", "--num-blocks", "16"], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PLUGINFER_ENGINE_PROCESS": "0"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"pluginfer: error: {path / 'model.safetensors'} is not a readable safetensors file (Error while "
        "deserializing header: incomplete metadata, file not fully covered); the file is truncated or corrupted: "
        "download it again"]


class _Exploit:
    """A pickle that would create a file when unpickled by plain torch.load(weights_only=False)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_allow_pickle_reads_tensors_only(tiny_llama_checkpoint, tmp_path):
    safetensors = _copy(tiny_llama_checkpoint, tmp_path, "safetensors")
    pickled = _copy(tiny_llama_checkpoint, tmp_path, "pickled")
    _pickle_only(pickled)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    answers = []
    for path, extra in ((safetensors, {}), (pickled, {"allow_pickle": True})):
        engine = LLMEngine(server_config(path, **extra))
        engine.add_request([11, 12, 13], params, "r")
        while engine.has_unfinished_requests():
            outputs = engine.step()
        answers.append(outputs[0].outputs[0].token_ids)
        engine.shutdown()
    assert answers[0] == answers[1]

    marker = tmp_path / "pwned"
    state = load_file(_weights(safetensors))
    state["model.norm.weight"] = _Exploit(marker)
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin: not loaded as weights only \(UnpicklingError"):
        LLMEngine(server_config(pickled, allow_pickle=True))
    assert not marker.exists()


def test_code_in_a_model_directory_is_never_run(tiny_llama_checkpoint, tmp_path):
    """config.json and tokenizer_config.json may point at Python files in the directory (``auto_map``, for
    transformers' trust_remote_code): pluginfer never imports them, whatever they claim."""
    path = _copy(tiny_llama_checkpoint, tmp_path)
    marker = tmp_path / "ran"
    (path / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Evil: pass\n")
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.Evil", "AutoModelForCausalLM": "evil.Evil"}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["evil.Evil", "evil.Evil"]}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    try:
        engine = LLMEngine(server_config(path))
    except ValueError as exc:  # transformers refuses a tokenizer that wants its code run: one line, no code run
        assert "\n" not in str(exc) and "trust_remote_code" in str(exc)
    else:
        engine.shutdown()
    assert not marker.exists()
