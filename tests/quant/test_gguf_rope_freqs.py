"""A GGUF file's ``rope_freqs.weight`` applied as the frequency divisors it holds, as llama.cpp does.

The fixture ``llamacpp-llama3-custom-f32.gguf`` was written by llama.cpp's own converter
(fixtures/make_gguf_fixtures.py) from a llama3-scaled checkpoint whose parameters are not Llama 3.1's
(factor 16, frequency factors 1 and 32, original context 1024): its divisors match no Llama 3.1 setting,
which the reader used to refuse. Two oracles: transformers on the same weights with the checkpoint's own
llama3 rope scaling, and llama.cpp itself (llama-cpp-python) reading the very same file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pluginfer import LLM
from pluginfer.engine.loader import read_hf_config
from pluginfer.models.gguf_llama import llama3_rope_factors
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts
from tests.quant.fixtures.make_gguf_fixtures import LLAMA3_CUSTOM_ROPE
from tests.quant.gguf_helpers import transformers_from_gguf

FIXTURE = Path(__file__).parent / "fixtures" / "llamacpp-llama3-custom-f32.gguf"
HEAD_DIM, THETA = 16, 10000.0


def file_factors(path: Path = FIXTURE) -> list[float]:
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight")
    return np.asarray(tensor.data, dtype=np.float32).tolist()


def test_the_file_holds_factors_no_llama31_setting_gives() -> None:
    factors = file_factors()
    assert factors == pytest.approx(llama3_rope_factors(THETA, HEAD_DIM, LLAMA3_CUSTOM_ROPE).tolist(), rel=1e-6)
    llama31 = {**LLAMA3_CUSTOM_ROPE, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "factor": max(factors)}
    assert not torch.allclose(llama3_rope_factors(THETA, HEAD_DIM, llama31), torch.tensor(factors))
    assert len(set(factors)) >= 5  # 1, the factor, and smoothed ones between


def test_rope_freqs_are_the_config_frequency_factors() -> None:
    config = read_hf_config(FIXTURE)
    assert config["rope_scaling"] == {"rope_type": "default", "frequency_factors": file_factors()}


@pytest.fixture(scope="module")
def ours() -> LLM:
    # a float32 KV cache, as the float32 oracle's (a GGUF file's default is float16, llama.cpp's)
    return LLM(model=str(FIXTURE), num_blocks=64, block_size=8, kv_cache_dtype="float32", max_model_len=256)


PROMPT = random_prompts(1000, [48], seed=21)[0]


def test_logits_equal_transformers_with_the_checkpoints_llama3_scaling(ours: LLM) -> None:
    oracle = transformers_from_gguf(FIXTURE, LLAMA3_CUSTOM_ROPE)
    expected = hf_logits(oracle, PROMPT)
    got = prefill_logits(ours, PROMPT)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert ours.generate([PROMPT], greedy(16))[0].outputs[0].token_ids == hf_greedy(oracle, PROMPT, 16)
    # The factors matter here: transformers without them is far off.
    plain = hf_logits(transformers_from_gguf(FIXTURE, {"rope_type": "default"}), PROMPT)
    assert (plain - expected).abs().max() > 100 * 1e-4


def test_logits_equal_llama_cpp_reading_the_same_file(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / FIXTURE.name
    shutil.copy(FIXTURE, path)
    # type_k/type_v 0 (GGML_TYPE_F32): a float32 KV cache; llama.cpp's default F16 cache alone moves logits ~1e-2.
    model = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False,
                            n_threads=1, type_k=0, type_v=0)
    model.eval(PROMPT)
    theirs = torch.tensor(np.array(model.scores[: len(PROMPT)]), dtype=torch.float32)
    # no cached prefix
    ours = LLM(model=str(FIXTURE), num_blocks=64, block_size=8, kv_cache_dtype="float32", max_model_len=256)
    # Both in float32, summed in other orders: measured at most 1e-5 apart (logits spread ~14).
    torch.testing.assert_close(prefill_logits(ours, PROMPT), theirs, atol=1e-4, rtol=1e-4)


def rewritten(out: Path, rope_freqs: np.ndarray, fields: dict[str, object] = {}) -> Path:  # noqa: B006
    """The fixture with its ``rope_freqs.weight`` replaced and string metadata ``fields`` added."""
    reader = gguf.GGUFReader(FIXTURE)
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for key, value in fields.items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    for tensor in reader.tensors:
        data = rope_freqs if tensor.name == "rope_freqs.weight" else tensor.data
        writer.add_tensor(tensor.name, data, raw_shape=None if tensor.name == "rope_freqs.weight"
                          else tuple(tensor.data.shape), raw_dtype=None if tensor.name == "rope_freqs.weight"
                          else tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_linear_scaling_and_rope_freqs_both_apply(tmp_path: Path) -> None:
    path = rewritten(tmp_path / "linear.gguf", np.array(file_factors(), dtype=np.float32),
                     {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    assert read_hf_config(path)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0,
                                                    "frequency_factors": file_factors()}


@pytest.mark.parametrize("case", ["length", "zero", "f16", "yarn"])
def test_rope_freqs_that_cannot_apply_are_named(case: str, tmp_path: Path) -> None:
    factors = np.array(file_factors(), dtype=np.float32)
    fields: dict[str, object] = {}
    if case == "length":
        factors, problem = factors[:-1], r"holds 7 values; expected 8 positive finite rope frequency divisors"
    elif case == "zero":
        factors[3], problem = 0.0, r"holds 8 values; expected 8 positive finite"
    elif case == "f16":
        factors, problem = factors.astype(np.float16), "is F16; llama.cpp reads it as F32"
    else:
        fields = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
        problem = "with rope scaling type 'yarn' is not supported"
    path = rewritten(tmp_path / f"{case}.gguf", factors, fields)
    with pytest.raises(ValueError, match=rf"{case}\.gguf: tensor 'rope_freqs\.weight' {problem}"):
        read_hf_config(path)
