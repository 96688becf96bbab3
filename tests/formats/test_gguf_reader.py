"""formats/gguf/reader.py against gguf-py's GGUFReader: the same metadata values and the same tensor views."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from pluginfer.cli.convert import convert_to_gguf
from pluginfer.formats.gguf.reader import GGUFFile

FIXTURES = Path(__file__).resolve().parent.parent / "quant" / "fixtures"


def assert_same_as_gguf_py(path: Path) -> None:
    ours, reference = GGUFFile(path), gguf.GGUFReader(path)
    keys = [key for key in reference.fields if not key.startswith("GGUF.")]  # gguf-py lists the header too
    assert sorted(keys) == sorted([*ours.fields, *ours._arrays])
    for key in keys:
        expected = reference.get_field(key).contents()
        assert ours.get(key) == expected, key
        assert type(ours.get(key)) is type(expected), key
        assert key in ours
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.tensor_type == theirs.tensor_type and mine.shape == tuple(theirs.shape.tolist())
        assert mine.data_offset == theirs.data_offset and mine.n_bytes == theirs.n_bytes
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data, equal_nan=True), mine.name
        assert mine.data.flags.writeable  # copy-on-write: torch.from_numpy wraps it without a warning


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.gguf")))
def test_llama_cpp_files_read_as_gguf_py_reads_them(name: str) -> None:
    assert_same_as_gguf_py(FIXTURES / name)


@pytest.mark.parametrize("quant", ["q8_0", "q4_1", "q4_k", "bf16"])
def test_our_converted_files_read_as_gguf_py_reads_them(quant: str, tiny_llama_checkpoint: tuple[Path, object],
                                                        tmp_path: Path) -> None:
    assert_same_as_gguf_py(convert_to_gguf(tiny_llama_checkpoint[0], tmp_path / "tiny.gguf", quant, "f32"))


def test_every_value_type(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    for kind in (gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT16,
                 gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
                 gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64):
        writer.add_key_value(f"test.{kind.name}", 7, kind)
        writer.add_key_value(f"test.{kind.name}.array", [1, 2, 3], gguf.GGUFValueType.ARRAY, kind)
    writer.add_float32("test.f32", 0.5)
    writer.add_float64("test.f64", -1.25)
    writer.add_bool("test.bool", True)
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.f32s", [0.25, -2.0])
    writer.add_string("test.string", "é ü 中文")
    writer.add_array("test.strings", ["", "a", "é", "中文"])
    writer.add_array("test.empty", [])
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.arange(8, dtype=np.float16).reshape(2, 4))
    writer.add_tensor("i32", np.arange(5, dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_py(path)
    ours = GGUFFile(path)
    assert ours.get("test.strings") == ["", "a", "é", "中文"] and ours.get("test.missing", 3) == 3
    assert ours.get("general.alignment") == 64 and ours.tensors[0].data_offset % 64 == 0
    # An array's length without decoding it (how a GGUF model's config counts its vocabulary), None for the rest.
    fresh = GGUFFile(path, tensors=False)
    lengths = {key: fresh.array_length(key) for key in ("test.strings", "test.f32s", "test.UINT64.array",
                                                        "test.string", "test.f32", "test.missing")}
    assert lengths == {"test.strings": 4, "test.f32s": 2, "test.UINT64.array": 3,
                       "test.string": None, "test.f32": None, "test.missing": None}
    assert all(fresh.array_length(key) == len(ours.get(key)) for key in ("test.strings", "test.bools"))


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b"XXXX" + b"\0" * 20, "GGUF magic invalid"),
    (b"GGUF" + (99).to_bytes(4, "little") + b"\0" * 16, "version 99"),
    (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (5).to_bytes(8, "little"),
     "the header breaks after byte 24"),
])
def test_a_header_that_is_not_gguf_is_refused(data: bytes, message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        GGUFFile(path)


def test_a_string_past_the_end_and_an_unknown_value_type_are_named(tmp_path: Path) -> None:
    header = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    key = (3).to_bytes(8, "little") + b"abc"
    path = tmp_path / "bad.gguf"
    path.write_bytes(header + key + (8).to_bytes(4, "little") + (1000).to_bytes(8, "little") + b"short")
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFFile(path)
    path.write_bytes(header + key + (77).to_bytes(4, "little"))
    with pytest.raises(ValueError, match="'abc' has the unknown value type 77"):
        GGUFFile(path)


def test_the_metadata_alone() -> None:
    """``tensors=False`` reads the same metadata, no tensor table, and imports nothing that imports torch."""
    path = FIXTURES / "llamacpp-qwen2-q8_0.gguf"
    full, metadata = GGUFFile(path), GGUFFile(path, tensors=False)
    assert metadata.tensors == [] and full.tensors
    assert metadata.fields == full.fields and metadata.get("tokenizer.ggml.tokens") == full.get("tokenizer.ggml.tokens")
    code = (f"import sys; from pluginfer.formats.gguf.reader import GGUFFile; GGUFFile({str(path)!r}, tensors=False); "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == \
        "False"
