"""The quant-method conformance kit (``pluginfer.testing.quant_contract``) passes pluginfer's quant methods, each
against a dense weight from an oracle (the format's definition, gguf-py's dequantization, GPTQModel's), and
fails a broken method naming the member that broke the protocol.

The native kernels of short steps quantize the activations to 8 bits as llama.cpp does (docs/quantization.md),
so the block formats are held to 1% of the output's scale rather than to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pluginfer.core.registry import get_registry
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from pluginfer.quant import ggml_quantize
from pluginfer.quant.unquantized import UnquantizedLinear
from pluginfer.testing.quant_contract import check_quant_method
from tests.quant.test_gptq import FIXTURES, checkpoint_tensors, oracle_weights, quant_config

BLOCK_FORMATS = dict(rtol=1e-2)


def method(name: str, config: dict | None = None) -> object:
    return get_registry().load("quant", name)(config)


def weight(rows: int = 96, cols: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unquantized(dtype: torch.dtype) -> None:
    dense = weight().to(dtype)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    check_quant_method(method("none"), {"weight": dense}, dense.float(), dtype=dtype, **tolerance)


def test_int8() -> None:
    """W8A16 by its definition: per output row, ``scale = max |w| / 127`` and ``round(w / scale)``."""
    dense = weight()
    scale = dense.abs().amax(dim=1, keepdim=True) / 127
    check_quant_method(method("int8"), {"weight": dense}, torch.round(dense / scale).clamp(-127, 127) * scale)


def _gguf_dense(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: torch.Size) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw.numpy(), qtype)).reshape(shape).float()


def test_q8_0_quantized_at_load() -> None:
    """gguf-py's quantizer (llama.cpp's bytes) and its dequantization are the oracle."""
    dense = weight()
    raw = torch.from_numpy(quants.quantize(dense.numpy(), GGMLQuantizationType.Q8_0))
    check_quant_method(method("q8_0"), {"weight": dense}, _gguf_dense(raw, GGMLQuantizationType.Q8_0, dense.shape),
                       **BLOCK_FORMATS)


def test_q4_k_quantized_at_load() -> None:
    """gguf-py has no Q4_K quantizer: pluginfer's (llama.cpp's bytes, tests/quant/test_ggml_blocks.py) makes the
    blocks, gguf-py dequantizes them."""
    dense = weight()
    raw = ggml_quantize.quantize(dense, GGMLQuantizationType.Q4_K)
    check_quant_method(method("q4_k"), {"weight": dense}, _gguf_dense(raw, GGMLQuantizationType.Q4_K, dense.shape),
                       **BLOCK_FORMATS)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_gguf_file_tensors_and_vocabulary_table(type_name: str) -> None:
    qtype = GGMLQuantizationType[type_name]
    dense = weight()
    raw = ggml_quantize.quantize(dense, qtype)
    tensor = GGMLTensor(raw, qtype, dense.shape, "blk.0.ffn_up.weight")
    reference = _gguf_dense(raw, qtype, dense.shape)
    vocab_dense = weight(40, 256, seed=1)
    vocab_raw = ggml_quantize.quantize(vocab_dense, qtype)
    vocab = (GGMLTensor(vocab_raw, qtype, vocab_dense.shape, "token_embd.weight"),
             _gguf_dense(vocab_raw, qtype, vocab_dense.shape))
    check_quant_method(method("gguf"), {"weight": tensor}, reference, vocab=vocab, **BLOCK_FORMATS)


@pytest.mark.parametrize("fixture", ["gptq_b4_g32_act_asym", "gptq_b8_gall_act_sym", "awq_b4_g32"])
def test_gptq_and_awq_checkpoints_against_gptqmodel(fixture: str) -> None:
    """One linear of a checkpoint GPTQModel made (tests/quant/fixtures/make_gptq_awq.py), against GPTQModel's own
    dequantization of it."""
    assert (FIXTURES / fixture).is_dir(), fixture
    prefix = "model.layers.0.mlp.down_proj."
    tensors = {name[len(prefix):]: tensor for name, tensor in checkpoint_tensors(fixture).items()
               if name.startswith(prefix)}
    config = quant_config(fixture)
    check_quant_method(method(config["quant_method"], config), tensors,
                       oracle_weights(fixture)[prefix + "weight"].float(), **BLOCK_FORMATS)


# -- broken methods: the kit names what broke --------------------------------------------------------------
class DropsTheBias(UnquantizedLinear):
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super().apply(layer, x, None)


class ExtraScale(UnquantizedLinear):
    def create_weights(self, layer: torch.nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: object = None) -> None:
        super().create_weights(layer, input_size, output_size, dtype)
        layer.register_parameter("weight_scale", torch.nn.Parameter(torch.ones(output_size), requires_grad=False))


class AnswersInFloat32(UnquantizedLinear):
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super().apply(layer, x, bias).float()


class KeepsAnything(UnquantizedLinear):
    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype, backend: object) -> object:
        return loaded


class Unnamed(UnquantizedLinear):
    name = ""


class TableFromTheTop:
    """A dense vocabulary table that forgets ``start``: rows ``0:rows`` instead of ``start:start + rows``."""

    def __init__(self, dense: torch.Tensor, rows: int) -> None:
        self.dense, self.rows = dense[:rows], rows

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense[ids]

    def logits(self, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.dense, bias)


class ForgetsTheStart(UnquantizedLinear):
    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype, backend: object) -> object:
        return TableFromTheTop(loaded, rows)


@pytest.mark.parametrize(("broken", "dtype", "message"), [
    (DropsTheBias, torch.float32, r"QuantMethod\.apply \(DropsTheBias\): x of shape \(1, 256\): differs from the "
                                  r"dense reference"),
    (ExtraScale, torch.float32, r"QuantMethod\.create_weights \(ExtraScale\): registered \['weight_scale'\], which "
                                r"the checkpoint does not hold"),
    (AnswersInFloat32, torch.bfloat16, r"QuantMethod\.apply \(AnswersInFloat32\): x of shape \(1, 256\): returned "
                                       r"torch\.float32, the model dtype is torch\.bfloat16"),
    (KeepsAnything, torch.float32, r"QuantMethod\.vocab_table \(KeepsAnything\): for an object not in this format: "
                                   r"None or a ValueError, got object"),
    (Unnamed, torch.float32, r"QuantMethod\.name \(Unnamed\): a non-empty str, got ''"),
], ids=lambda value: value.__name__ if isinstance(value, type) else "")
def test_a_broken_method_fails_naming_the_member(broken: type, dtype: torch.dtype, message: str) -> None:
    dense = weight().to(dtype)
    with pytest.raises(AssertionError, match=message):
        check_quant_method(broken, {"weight": dense}, dense.float(), dtype=dtype, atol=1e-2, rtol=1e-2)


def test_a_vocabulary_table_of_the_wrong_rows_is_named() -> None:
    dense, table = weight(), weight(40, 256, seed=1)
    with pytest.raises(AssertionError, match=r"QuantMethod\.vocab_table\(\.\.\.\)\.embed \(ForgetsTheStart\): ids "
                                             r"\[0, 34, 2, 2, 17\]: differs from the dense reference"):
        check_quant_method(ForgetsTheStart, {"weight": dense}, dense, vocab=(table, table))


def test_a_checkpoint_tensor_without_a_parameter_is_named() -> None:
    dense = weight()
    with pytest.raises(AssertionError, match=r"QuantMethod\.create_weights \(UnquantizedLinear\): registered no "
                                             r"parameter for the checkpoint's \['qweight'\]"):
        check_quant_method(method("none"), {"weight": dense, "qweight": dense}, dense)
