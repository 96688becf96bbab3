"""load_named_weights: routing of HF checkpoint names to (fused) parameters, and strict accounting."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.backends.cpu import backend as cpu
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext, ShardSpec
from pluginfer.layers.context import building
from pluginfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pluginfer.layers.norm import RMSNorm
from pluginfer.layers.weights import load_named_weights
from pluginfer.quant import unquantized
from pluginfer.quant.sharding import UNSPLIT

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 32, 4, 2, 8, 48, 20
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


class CountingQuant:
    """The unquantized method, counting process_weights_after_loading per layer."""

    def __init__(self) -> None:
        self.inner = unquantized.build()
        self.name = self.inner.name
        self.processed: list[nn.Module] = []

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        self.inner.create_weights(layer, input_size, output_size, dtype, shard)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.processed.append(layer)
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.inner.apply(layer, x, bias)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True)
        self.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE, INTERMEDIATE])
        self.down_proj = RowParallelLinear(INTERMEDIATE, HIDDEN)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()
        self.input_layernorm = RMSNorm(HIDDEN)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer(), Layer()])


class TinyModel(nn.Module):
    """HF llama naming (``model.layers.N.self_attn.q_proj.weight`` ...) with an optionally tied lm_head."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.model = Decoder()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def build(tied: bool = False) -> tuple[TinyModel, CountingQuant]:
    quant = CountingQuant()
    ctx = BuildContext(backend=cpu.build(), quant=quant, collective=single.build(), dtype=torch.float32,
                       max_model_len=64)
    with building(ctx):
        return TinyModel(tied), quant


def checkpoint(tied: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors as an HF llama checkpoint names and shapes them (q, k, v, gate, up stored separately)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    tensors = {"model.embed_tokens.weight": randn(VOCAB, HIDDEN)}
    for i in range(2):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "self_attn.q_proj.weight": randn(HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.k_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.v_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.q_proj.bias": randn(HEADS * HEAD_DIM),
            prefix + "self_attn.k_proj.bias": randn(KV_HEADS * HEAD_DIM),
            prefix + "self_attn.v_proj.bias": randn(KV_HEADS * HEAD_DIM),
            prefix + "self_attn.o_proj.weight": randn(HIDDEN, HEADS * HEAD_DIM),
            prefix + "mlp.gate_proj.weight": randn(INTERMEDIATE, HIDDEN),
            prefix + "mlp.up_proj.weight": randn(INTERMEDIATE, HIDDEN),
            prefix + "mlp.down_proj.weight": randn(HIDDEN, INTERMEDIATE),
            prefix + "input_layernorm.weight": randn(HIDDEN),
        })
    if not tied:
        tensors["lm_head.weight"] = randn(VOCAB, HIDDEN)
    return tensors


def shuffled(tensors: dict[str, torch.Tensor], seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint shards stream tensors in no particular order."""
    items = list(tensors.items())
    random.Random(seed).shuffle(items)
    return items


def without(tensors: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    assert all(name in tensors for name in names)
    return {name: tensor for name, tensor in tensors.items() if name not in names}


def test_fused_qkv_and_gate_up_are_routed_to_their_shards() -> None:
    model, quant = build()
    tensors = checkpoint()
    load_named_weights(model, shuffled(tensors))
    x = torch.randn(5, HIDDEN)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."

        def dense(name: str, bias: bool = False, prefix: str = prefix) -> torch.Tensor:
            return F.linear(x, tensors[prefix + name + ".weight"], tensors[prefix + name + ".bias"] if bias else None)

        qkv = torch.cat([dense("self_attn.q_proj", True), dense("self_attn.k_proj", True),
                         dense("self_attn.v_proj", True)], dim=-1)
        torch.testing.assert_close(layer.self_attn.qkv_proj(x), qkv, **TOLERANCE)
        gate_up = torch.cat([dense("mlp.gate_proj"), dense("mlp.up_proj")], dim=-1)
        torch.testing.assert_close(layer.mlp.gate_up_proj(x), gate_up, **TOLERANCE)
        hidden = torch.randn(5, INTERMEDIATE)
        torch.testing.assert_close(layer.mlp.down_proj(hidden), F.linear(hidden, tensors[prefix + "mlp.down_proj.weight"]),
                                   **TOLERANCE)
        assert torch.equal(layer.input_layernorm.weight, tensors[prefix + "input_layernorm.weight"])
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    linear_layers = [m for m in model.modules() if hasattr(m, "quant_method")]
    assert len(linear_layers) == 8
    assert sorted(map(id, quant.processed)) == sorted(map(id, linear_layers)), "processed once each, after loading"


def test_already_fused_checkpoint_tensors_load_whole() -> None:
    """Checkpoints such as Phi-3 store qkv_proj / gate_up_proj fused; those names need no routing."""
    model, _ = build()
    tensors = checkpoint()
    fused = dict(tensors)
    for i in range(2):
        prefix = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            parts = [fused.pop(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv"]
            fused[f"{prefix}self_attn.qkv_proj.{kind}"] = torch.cat(parts)
        fused[prefix + "mlp.gate_up_proj.weight"] = torch.cat(
            [fused.pop(prefix + "mlp.gate_proj.weight"), fused.pop(prefix + "mlp.up_proj.weight")])
    load_named_weights(model, shuffled(fused))
    x = torch.randn(3, HIDDEN)
    layer = model.model.layers[1]
    expected = F.linear(x, fused["model.layers.1.self_attn.qkv_proj.weight"],
                        fused["model.layers.1.self_attn.qkv_proj.bias"])
    torch.testing.assert_close(layer.self_attn.qkv_proj(x), expected, **TOLERANCE)


def test_unknown_checkpoint_tensor_is_a_key_error_naming_it() -> None:
    model, quant = build()
    tensors = {**checkpoint(), "model.layers.0.self_attn.rotary_emb.cos_cached": torch.zeros(3)}
    with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.rotary_emb\.cos_cached"):
        load_named_weights(model, shuffled(tensors))


@pytest.mark.parametrize("missing", [
    "model.layers.1.input_layernorm.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "lm_head.weight",
    # One shard of a fused parameter: q and v arrived, k did not.
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.bias",
    "model.layers.1.mlp.up_proj.weight",
])
def test_missing_tensor_is_a_key_error_listing_it(missing: str) -> None:
    model, quant = build()
    with pytest.raises(KeyError) as error:
        load_named_weights(model, shuffled(without(checkpoint(), missing)))
    message = str(error.value)
    assert missing in message and "1 tensor" in message, message
    incomplete = missing.rsplit(".", 1)[0].replace("k_proj", "qkv_proj").replace("v_proj", "qkv_proj") \
        .replace("up_proj", "gate_up_proj")
    named = dict(model.named_modules())
    assert all(layer is not named.get(incomplete) for layer in quant.processed), \
        "a layer is processed only once all its tensors arrived"


def test_missing_shards_are_listed_by_checkpoint_name_per_fused_parameter() -> None:
    """Layer 0 lacks k_proj, layer 1 lacks all of q/k/v: the accounting is per fused parameter."""
    model, _ = build()
    absent = ["model.layers.0.self_attn.k_proj.weight"] + [
        f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    tensors = without(checkpoint(), *absent)
    with pytest.raises(KeyError) as error:
        load_named_weights(model, list(tensors.items()))
    message = str(error.value)
    assert all(name in message for name in absent), message
    assert "4 tensor" in message
    assert "model.layers.0.self_attn.q_proj" not in message and "bias" not in message


def test_shape_mismatch_of_a_plain_parameter_names_the_tensor() -> None:
    model, _ = build()
    tensors = {**checkpoint(), "model.layers.1.input_layernorm.weight": torch.ones(HIDDEN + 1)}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.input_layernorm\.weight"):
        load_named_weights(model, shuffled(tensors))


def test_ignore_skips_names_containing_a_part() -> None:
    # Default: the rope table some checkpoints carry is skipped.
    model, _ = build()
    tensors = {**checkpoint(), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    load_named_weights(model, shuffled(tensors))
    # A custom ignore replaces the default one.
    extra = {**checkpoint(), "model.vision_tower.patch.weight": torch.ones(2)}
    load_named_weights(build()[0], shuffled(extra), ignore=("vision_tower.",))
    with pytest.raises(KeyError, match="rotary_emb.inv_freq"):
        load_named_weights(build()[0], shuffled(tensors), ignore=("vision_tower.",))
    # Ignoring a needed tensor leaves its parameter unloaded, which is still an error.
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.down_proj\.weight"):
        load_named_weights(build()[0], shuffled(checkpoint()), ignore=("layers.0.mlp.down_proj",))


def test_optional_parameters_may_stay_unloaded_but_load_when_present() -> None:
    # A tied lm_head shares the embedding: it is listed under both names, so it must be optional.
    model, _ = build(tied=True)
    tensors = checkpoint(tied=True)
    with pytest.raises(KeyError, match=r"lm_head\.weight"):
        load_named_weights(model, shuffled(tensors))
    model, _ = build(tied=True)
    load_named_weights(model, shuffled(tensors), optional=("lm_head.",))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
    # When the optional tensor is in the checkpoint, it is loaded like any other.
    model, _ = build()
    tensors = checkpoint()
    load_named_weights(model, shuffled(tensors), optional=("lm_head.",))
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
