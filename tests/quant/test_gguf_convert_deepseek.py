"""``pluginfer convert`` of DeepSeek-V2/V3 checkpoints (llama.cpp's ``deepseek2``), against llama.cpp's own converter:
the committed fixtures were written by it from the same seeded checkpoints (fixtures/make_gguf_fixtures.py), so our
file must hold the same metadata and the same tensors, byte for byte in F16; our engine then reads it as it reads
llama.cpp's (whose generation test_gguf_llamacpp_moe.py checks against transformers)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pluginfer import LLM
from pluginfer.cli.convert import convert_to_gguf
from tests.checkpoints import copy_tokenizer, greedy, random_prompts
from tests.quant.fixtures.make_gguf_fixtures import MODELS, source_model

FIXTURES = Path(__file__).parent / "fixtures"
STEMS = ("llamacpp-deepseek2", "llamacpp-deepseek3")
# Keys that name the file, not the model: the writer's name, and the tokenizer (our converter writes the checkpoint's
# tokenizer as a plain byte-level BPE; llama.cpp's names its pre-tokenizer by a hash of the vocabulary).
DIFFERENT = ("general.", "tokenizer.", "GGUF.")


def fields(reader: gguf.GGUFReader) -> dict[str, object]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith(DIFFERENT)}


@pytest.fixture(scope="module")
def tokenizer_1000(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixtures' tokenizer: the demo tokenizer of 1000 tokens (the checkpoints' vocab_size)."""
    from pluginfer.demo.tokenizer import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tokenizer_1000"), vocab_size=1000)


@pytest.fixture(scope="module", params=STEMS)
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              tokenizer_1000: Path) -> tuple[str, Path]:
    stem = request.param
    directory = tmp_path_factory.mktemp(stem)
    source_model(*MODELS[stem][:2]).save_pretrained(directory, safe_serialization=True)
    copy_tokenizer(tokenizer_1000, directory)
    return stem, convert_to_gguf(directory, directory / "ours-f16.gguf", "f16", "f16")


def test_the_file_holds_what_llama_cpps_converter_writes(converted: tuple[str, Path]) -> None:
    stem, path = converted
    ours, theirs = gguf.GGUFReader(path), gguf.GGUFReader(FIXTURES / f"{stem}-f16.gguf")
    assert ours.fields["general.architecture"].contents() == "deepseek2"
    assert fields(ours) == fields(theirs)
    ours_tensors = {tensor.name: tensor for tensor in ours.tensors}
    theirs_tensors = {tensor.name: tensor for tensor in theirs.tensors}
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    for name, tensor in theirs_tensors.items():
        mine = ours_tensors[name]
        assert (mine.tensor_type, list(mine.shape)) == (tensor.tensor_type, list(tensor.shape)), name
        assert np.array_equal(np.asarray(mine.data), np.asarray(tensor.data)), name


def test_our_engine_reads_it_as_llama_cpps_file(converted: tuple[str, Path]) -> None:
    stem, path = converted
    prompts = random_prompts(1000, [9, 17], seed=5)
    ours = LLM(model=str(path), num_blocks=32, block_size=8).generate(prompts, greedy(6))
    theirs = LLM(model=str(FIXTURES / f"{stem}-f16.gguf"), num_blocks=32, block_size=8).generate(prompts, greedy(6))
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]


def test_a_yarn_config_gguf_cannot_carry_is_refused(tmp_path: Path, tokenizer_1000: Path) -> None:
    """A deepseek2 file keeps one YaRN multiplier (0.1 * mscale_all_dim): mscale and mscale_all_dim must agree."""
    arch, config = MODELS["llamacpp-deepseek3"][:2]
    config = {**config, "max_position_embeddings": 256,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}}
    source_model(arch, config).save_pretrained(tmp_path, safe_serialization=True)
    copy_tokenizer(tokenizer_1000, tmp_path)
    with pytest.raises(ValueError, match="mscale 1.0 differs from mscale_all_dim 0.8"):
        convert_to_gguf(tmp_path, tmp_path / "yarn.gguf", "f16", "f16")


def test_q8_0_types_as_llama_cpps(tmp_path: Path, tokenizer_1000: Path) -> None:
    """Each tensor in the type llama.cpp's converter gives it at --outtype q8_0 (the routers and norms F32, each
    rest Q8_0 where its rows divide into blocks of 32, else F16); the F32 ones byte for byte."""
    stem = "llamacpp-deepseek2"
    source_model(*MODELS[stem][:2]).save_pretrained(tmp_path, safe_serialization=True)
    copy_tokenizer(tokenizer_1000, tmp_path)
    ours = gguf.GGUFReader(convert_to_gguf(tmp_path, tmp_path / "ours-q8_0.gguf", "q8_0", "q8_0"))
    theirs = {tensor.name: tensor for tensor in gguf.GGUFReader(FIXTURES / f"{stem}-q8_0.gguf").tensors}
    assert sorted(tensor.name for tensor in ours.tensors) == sorted(theirs)
    for tensor in ours.tensors:
        assert tensor.tensor_type == theirs[tensor.name].tensor_type, tensor.name
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            assert np.array_equal(np.asarray(tensor.data), np.asarray(theirs[tensor.name].data)), tensor.name
