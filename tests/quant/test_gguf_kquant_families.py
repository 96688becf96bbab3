"""K-quant files of dense families beside llama (Gemma 3: Q4_K_M, Gemma 2: Q5_K_M) and a MoE family (Qwen3-MoE:
Q4_K_M),
quantized by llama.cpp's own quantizer (fixtures/make_gguf_fixtures.py, ``QUANTIZER_TYPES``).

Oracles: ggml's own dequantization (``to_float`` of llama-cpp-python's libggml-base) for every quantized tensor;
with float activations, transformers with the file's weights (gguf-py's dequantization); on the default path
(int8 activations), llama.cpp running the same file: mean NLL within 1 % and the same top-1 token nearly everywhere.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pluginfer import LLM
from pluginfer.backends.cpu.quant import ggml_dequantize
from pluginfer.engine.loader import iter_weights, read_hf_config
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts
from tests.quant.fixtures.make_gguf_fixtures import MODELS, source_config
from tests.quant.gguf_helpers import transformers_from_gguf, transformers_from_source

FIXTURES = Path(__file__).parent / "fixtures"
FILES = {  # file -> (the K-quant types llama.cpp's quantizer chose for its matrices, a quantized HF weight)
    "llamacpp-gemma3-k-q4_k_m.gguf": ({"Q4_K", "Q6_K"}, "model.layers.5.self_attn.q_proj.weight"),
    "llamacpp-gemma2-k-q5_k_m.gguf": ({"Q5_K", "Q6_K"}, "model.layers.1.mlp.down_proj.weight"),
    "llamacpp-qwen3moe-k-q4_k_m.gguf": ({"Q4_K", "Q6_K"}, "model.layers.1.self_attn.v_proj.weight"),
}
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}


def ggml_to_float(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, count: int) -> np.ndarray:
    """ggml's own ``type_traits[qtype].to_float`` over ``count`` weights (the library llama.cpp runs)."""
    llama_cpp = pytest.importorskip("llama_cpp")

    class TypeTraits(ctypes.Structure):  # ggml.h's struct ggml_type_traits
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    traits = lib.ggml_get_type_traits(int(qtype)).contents
    assert traits.type_name.decode().upper() == qtype.name
    to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(traits.to_float)
    source = np.ascontiguousarray(raw)
    out = np.empty(count, dtype=np.float32)
    to_float(source.ctypes.data, out.ctypes.data, count)
    return out


def oracle(path: Path) -> torch.nn.Module:
    architecture, config, _ = MODELS[path.stem.rsplit("-", 1)[0]]
    if architecture == "Qwen3MoeForCausalLM":  # transformers reads qwen3moe files (test_gguf_llamacpp_moe.py)
        fields = gguf.GGUFReader(path).fields
        return transformers_from_gguf(path, config_fields={
            "moe_intermediate_size": fields["qwen3moe.expert_feed_forward_length"].contents(), "norm_topk_prob": True})
    return transformers_from_source(path, architecture, source_config(config))


@pytest.mark.parametrize("name", sorted(FILES))
def test_kquant_blocks_dequantize_as_ggml(name: str) -> None:
    types, _ = FILES[name]
    tensors = [t for t in gguf.GGUFReader(FIXTURES / name).tensors if t.tensor_type.name in K_QUANTS]
    assert {t.tensor_type.name for t in tensors} == types
    for tensor in tensors:
        count = int(np.prod(tensor.shape))
        cols = int(tensor.shape[0])
        raw = torch.from_numpy(np.array(tensor.data).reshape(count // cols, -1))  # a writable copy
        ours = ggml_dequantize(raw, int(tensor.tensor_type), cols)
        assert ours is not None, tensor.name
        theirs = ggml_to_float(tensor.data, tensor.tensor_type, count)
        assert np.array_equal(ours.numpy().reshape(-1), theirs), tensor.name


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FILES))
def test_kquant_file_with_float_activations_generates_like_transformers(name: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")
    path = FIXTURES / name
    types, linear = FILES[name]
    assert read_hf_config(path)["hidden_size"] == 256
    weights = dict(iter_weights(path))
    assert type(weights[linear]) is GGMLTensor and weights[linear].qtype.name in types
    # a float32 KV cache, as the float32 oracle's (a GGUF file's default is float16, llama.cpp's)
    llm = LLM(model=str(path), num_blocks=64, block_size=8, kv_cache_dtype="float32")
    model = oracle(path)
    prompt = random_prompts(1000, [24], seed=9)[0]
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(model, prompt), atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], greedy(16))[0].outputs[0].token_ids == hf_greedy(model, prompt, 16)


def llama_cpp_logits(path: Path, prompt: list[int], tmp_path: Path) -> torch.Tensor:
    """llama.cpp's logits at every position of ``prompt`` (a float32 KV cache, as ours)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    copy = tmp_path / path.name  # llama.cpp maps the file; a copy keeps the fixture's pages out of its way
    shutil.copy(path, copy)
    model = llama_cpp.Llama(model_path=str(copy), n_ctx=256, n_batch=256, logits_all=True, verbose=False,
                            n_threads=1, type_k=0, type_v=0)
    model.eval(prompt)
    return torch.tensor(np.array(model.scores[: len(prompt)]), dtype=torch.float32)


def mean_nll(logits: torch.Tensor, prompt: list[int]) -> float:
    """The mean negative log-likelihood of each next prompt token."""
    targets = torch.tensor(prompt[1:])
    return torch.nn.functional.cross_entropy(logits[:-1].double(), targets).item()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FILES))
def test_default_path_nll_within_one_percent_of_llama_cpp(name: str, tmp_path: Path) -> None:
    path = FIXTURES / name
    prompt = random_prompts(1000, [96], seed=3)[0]
    theirs = llama_cpp_logits(path, prompt, tmp_path)
    ours = prefill_logits(LLM(model=str(path), num_blocks=64, block_size=8, kv_cache_dtype="float32",
                              max_model_len=256), prompt)
    assert abs(mean_nll(ours, prompt) - mean_nll(theirs, prompt)) <= 0.01 * mean_nll(theirs, prompt)
    # both quantize activations (llama.cpp: Q8_K rows; ours: int8 per row), so logits differ a little, not the picks
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
