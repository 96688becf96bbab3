"""Mixture-of-experts and latent-attention files written by llama.cpp's own converter
(fixtures/make_gguf_fixtures.py): Mixtral (a llama file with merged experts), qwen2moe, qwen3moe, deepseek2
(V2 and V3 routers, the split ``attn_k_b`` / ``attn_v_b``).

Oracles: transformers reading the same file (gguf-py's dequantization) where it reads the architecture
(qwen2moe, qwen3moe); elsewhere transformers on the file's source checkpoint, made again from its seed (checked
against the file's embedding first), each weight passed through gguf-py's F16 or Q8_0 as the converter wrote it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pluginfer import LLM
from pluginfer.engine.loader import iter_weights, read_hf_config
from pluginfer.formats.gguf.checkpoint import GGMLTensor
from pluginfer.layers.moe import FusedExperts
from tests.checkpoints import greedy, hf_greedy, hf_logits, prefill_logits, random_prompts
from tests.quant.fixtures.make_gguf_fixtures import MODELS, source_model
from tests.quant.gguf_helpers import transformers_from_gguf

FIXTURES = Path(__file__).parent / "fixtures"
FILES = {  # file -> (our architecture, the type of its expert weights)
    "llamacpp-mixtral-f16.gguf": ("MixtralForCausalLM", "F16"),
    "llamacpp-mixtral-q8_0.gguf": ("MixtralForCausalLM", "Q8_0"),
    "llamacpp-qwen2moe-f16.gguf": ("Qwen2MoeForCausalLM", "F16"),
    "llamacpp-qwen2moe-q8_0.gguf": ("Qwen2MoeForCausalLM", "Q8_0"),
    "llamacpp-qwen3moe-f16.gguf": ("Qwen3MoeForCausalLM", "F16"),
    "llamacpp-qwen3moe-q8_0.gguf": ("Qwen3MoeForCausalLM", "Q8_0"),
    "llamacpp-deepseek2-f16.gguf": ("DeepseekV2ForCausalLM", "F16"),
    "llamacpp-deepseek2-q8_0.gguf": ("DeepseekV2ForCausalLM", "Q8_0"),
    "llamacpp-deepseek3-f16.gguf": ("DeepseekV3ForCausalLM", "F16"),
}


@pytest.fixture(autouse=True)
def float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 activations against dequantized tiles, as transformers multiplies them (test_gguf_llamacpp.py)."""
    monkeypatch.setenv("PLUGINFER_QUANT_ACTIVATIONS", "float")


def file_metadata(path: Path) -> tuple[str, dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(path)
    return reader.fields["general.architecture"].contents(), {tensor.name: tensor for tensor in reader.tensors}


def transformers_oracle(path: Path) -> torch.nn.Module:
    arch, tensors = file_metadata(path)
    if arch in ("qwen2moe", "qwen3moe"):
        fields = gguf.GGUFReader(path).fields
        # transformers' GGUF config mapping leaves the expert sizes out; llama.cpp's graph renormalizes
        # Qwen3-MoE's top-k weights (not Qwen2-MoE's), whatever the file says
        extra = {"moe_intermediate_size": fields[f"{arch}.expert_feed_forward_length"].contents()}
        if arch == "qwen3moe":
            extra["norm_topk_prob"] = True
        else:
            extra["shared_expert_intermediate_size"] = fields[f"{arch}.expert_shared_feed_forward_length"].contents()
        return transformers_from_gguf(path, config_fields=extra)
    stem = path.stem.rpartition("-")[0]
    model = source_model(*MODELS[stem][:2])
    embedding = tensors["token_embd.weight"]
    through_file_type(model, embedding.tensor_type)
    # the file is this checkpoint, made again (else the fixtures are stale: run make_gguf_fixtures.py again)
    assert np.array_equal(gguf.quants.dequantize(embedding.data, embedding.tensor_type),
                          model.model.embed_tokens.weight.detach().numpy())
    return model


def through_file_type(model: torch.nn.Module, qtype: gguf.GGMLQuantizationType) -> None:
    """Each weight llama.cpp's converter writes in the file's type (every matrix but the routers) as gguf-py
    quantizes it: along each GGUF row (DeepSeek's kv_b as attn_k_b, whose rows are each head's key columns)."""
    config = model.config

    def rounded(weight: torch.Tensor) -> torch.Tensor:
        levels = gguf.quants.quantize(weight.detach().numpy(), qtype)
        return torch.from_numpy(gguf.quants.dequantize(levels, qtype).astype(np.float32)).reshape(weight.shape)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2 or name.endswith("gate.weight") and param.dim() == 2 and "experts" not in name:
                continue
            if name.endswith("kv_b_proj.weight"):
                heads, nope = config.num_attention_heads, config.qk_nope_head_dim
                per_head = param.view(heads, nope + config.v_head_dim, -1)
                per_head[:, :nope] = rounded(per_head[:, :nope].transpose(1, 2).contiguous()).transpose(1, 2)
                per_head[:, nope:] = rounded(per_head[:, nope:].contiguous())
            else:
                param.copy_(rounded(param))


# the Q8_0 file's experts (32 inputs to down) split into no whole blocks over two ranks: the F16 file there
@pytest.mark.parametrize(("name", "tp"), [("llamacpp-qwen3moe-q8_0.gguf", 1), ("llamacpp-qwen2moe-f16.gguf", 2)])
def test_expert_adapters_on_experts_held_in_blocks_equal_peft(name: str, tp: int, tmp_path: Path) -> None:
    """A peft adapter on the routed experts' fused tensors over a llama.cpp file, whose experts stay linears of
    the gguf method (Q8_0 blocks; F16 split over two ranks): the deltas go around each expert's linears, the logits
    equal peft's on the file's transformers model (float activations), and the greedy tokens too."""
    peft = pytest.importorskip("peft")
    from pluginfer.engine.lora_request import LoRARequest
    from pluginfer.engine.step import NewRow, StepData

    path = FIXTURES / name
    oracle = transformers_oracle(path)
    torch.manual_seed(1)
    adapted = peft.get_peft_model(oracle, peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=[], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    adapted.save_pretrained(str(tmp_path / "experts"))
    adapted.eval()
    prompt = random_prompts(900, [24], seed=9)[0]
    request = LoRARequest("experts", 1, str(tmp_path / "experts"))
    # a float32 KV cache, as the float32 oracle's (a GGUF file's default is float16, llama.cpp's)
    with LLM(model=str(path), num_blocks=64, block_size=8, kv_cache_dtype="float32", enable_lora=True,
             max_lora_rank=4, tensor_parallel_size=tp) as llm:
        experts = next(m for m in llm.engine.executor.pipeline.modules() if isinstance(m, FusedExperts))
        assert experts.linears is not None
        got = llm.generate([prompt], greedy(16), lora_request=request)[0].outputs[0].token_ids
        logits = llm.engine.executor.run_step(StepData(
            token_ids=list(prompt), num_computed_tokens=[0], block_size=8, num_new_tokens=[len(prompt)],
            seq_ids=[10**9], new_rows=[NewRow(10**9, [40, 41, 42], lora_slot=0)], reset=True))[-1]
    want = hf_logits(adapted, prompt)[-1]
    with adapted.disable_adapter():
        assert (want - hf_logits(adapted, prompt)[-1]).abs().max() > 0.1
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    assert list(got) == hf_greedy(adapted, prompt, 16)


@pytest.mark.parametrize("name", list(FILES))
def test_llama_cpp_moe_file_generates_like_transformers(name: str) -> None:
    path = FIXTURES / name
    architecture, expert_type = FILES[name]
    config = read_hf_config(path)
    assert config["architectures"] == [architecture] and config["hidden_size"] == 64
    _, tensors = file_metadata(path)
    assert tensors["blk.1.ffn_gate_exps.weight"].tensor_type.name == expert_type
    assert len(tensors["blk.1.ffn_gate_exps.weight"].shape) == 3  # merged experts
    weights = dict(iter_weights(path))
    assert not any(".experts.gate_proj" in hf or ".experts.w1." in hf for hf in weights)  # split per expert
    if expert_type == "Q8_0":  # each expert's rows of blocks, and the other linears', stay in their blocks
        for hf in (next(hf for hf in weights if ".experts.3." in hf), "model.layers.1.self_attn.o_proj.weight"):
            assert isinstance(weights[hf], GGMLTensor) and weights[hf].qtype.name == "Q8_0", hf

    oracle = transformers_oracle(path)
    llm = LLM(model=str(path), num_blocks=64, block_size=8, kv_cache_dtype="float32")
    experts = next(module for module in llm.engine.executor.pipeline.modules() if isinstance(module, FusedExperts))
    # the experts are layers of the gguf quant method: the file's types, no stacked float copy
    assert experts.linears is not None and experts.gate_up_proj.numel() == 0
    assert {qtype.name if qtype else "float" for qtype, _ in experts.linears[0][1].gguf_groups} == \
        ({"Q8_0"} if expert_type == "Q8_0" else {"float"})
    prompt = random_prompts(900, [24], seed=9)[0]
    torch.testing.assert_close(prefill_logits(llm, prompt), hf_logits(oracle, prompt), atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], greedy(16))[0].outputs[0].token_ids == hf_greedy(oracle, prompt, 16)


def test_deepseek_split_kv_b_is_joined_per_head() -> None:
    """attn_k_b (each head's key block, transposed) and attn_v_b come back as the source's kv_b_proj."""
    path = FIXTURES / "llamacpp-deepseek2-f16.gguf"
    _, tensors = file_metadata(path)
    assert "blk.0.attn_k_b.weight" in tensors and "blk.0.attn_kv_b.weight" not in tensors
    source = source_model(*MODELS["llamacpp-deepseek2"][:2]).state_dict()
    weights = dict(iter_weights(path))
    for layer in (0, 1):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        assert torch.equal(weights[name], source[name].half().float())
    experts = source["model.layers.1.mlp.experts.gate_up_proj"]  # transformers' [experts, 2 * size, hidden]
    assert torch.equal(weights["model.layers.1.mlp.experts.2.up_proj.weight"], experts[2, 32:].half())


def test_deepseek_v3_router_bias_is_read() -> None:
    """V3's sigmoid router: its correction bias (``exp_probs_b``) under the name the pipeline holds it by."""
    path = FIXTURES / "llamacpp-deepseek3-f16.gguf"
    config = read_hf_config(path)
    assert (config["topk_method"], config["n_group"], config["topk_group"]) == ("noaux_tc", 2, 1)
    assert config["routed_scaling_factor"] == 2.5 and config["norm_topk_prob"] is True
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    source = source_model(*MODELS["llamacpp-deepseek3"][:2]).state_dict()
    assert torch.equal(dict(iter_weights(path))[name], source[name])


def copy_with_tensor(source: Path, out: Path, name: str, array: np.ndarray) -> Path:
    """``source`` with its metadata and tensors as they are, plus one tensor."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tuple(tensor.data.shape), raw_dtype=tensor.tensor_type)
    writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("name", ["llamacpp-qwen3moe-q8_0.gguf", "llamacpp-deepseek2-q8_0.gguf",
                                  "llamacpp-mixtral-q8_0.gguf"])
def test_unknown_tensor_is_named_in_one_line(name: str, tmp_path: Path) -> None:
    path = copy_with_tensor(FIXTURES / name, tmp_path / name, "blk.0.ffn_gate_up_exps_x.weight",
                            np.zeros((4, 8, 64), dtype=np.float32))
    assert read_hf_config(path)["hidden_size"] == 64  # the copy is a valid file
    with pytest.raises(KeyError) as raised:
        dict(iter_weights(path))
    message = str(raised.value)
    assert "'blk.0.ffn_gate_up_exps_x.weight' has no counterpart" in message and "\\n" not in message


@pytest.mark.slow
def test_experts_in_blocks_split_over_two_ranks_generate_like_transformers() -> None:
    """Tensor parallelism: each rank holds its slice of every expert's layers (and of the shared expert)."""
    path = FIXTURES / "llamacpp-qwen2moe-f16.gguf"
    prompt = random_prompts(900, [24], seed=9)[0]
    expected = hf_greedy(transformers_oracle(path), prompt, 16)
    with LLM(model=str(path), num_blocks=64, block_size=8, tensor_parallel_size=2) as llm:
        assert llm.generate([prompt], greedy(16))[0].outputs[0].token_ids == expected


def test_offloading_experts_held_in_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cache\.num_experts_offload_per_rank: experts of quant method 'gguf' stay "
                                         r"in the checkpoint's format and cannot be offloaded"):
        LLM(model=str(FIXTURES / "llamacpp-mixtral-q8_0.gguf"), num_blocks=16, block_size=8,
            num_experts_offload_per_rank=1)


def test_deepseek_whole_kv_b_of_older_files_reads_as_the_split_one(tmp_path: Path) -> None:
    """Files from before llama.cpp split kv_b: one ``attn_kv_b`` and the plain key/value lengths (no *_mla)."""
    source = FIXTURES / "llamacpp-deepseek2-f16.gguf"
    reader = gguf.GGUFReader(source)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    fields = reader.fields
    nope = fields["deepseek2.attention.key_length_mla"].contents() - fields["deepseek2.rope.dimension_count"].contents()
    path = tmp_path / "deepseek2-kv-b.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    for field in fields.values():
        if field.name.startswith(("GGUF.", "general.architecture", "deepseek2.attention.key_length",
                                  "deepseek2.attention.value_length")):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_key_length(fields["deepseek2.attention.key_length_mla"].contents())  # nope + rope, per head
    writer.add_value_length(fields["deepseek2.attention.value_length_mla"].contents())
    for tensor in reader.tensors:
        if ".attn_v_b." in tensor.name:
            continue
        if ".attn_k_b." in tensor.name:  # [heads, kv_lora_rank, nope] and [heads, v, kv_lora_rank] -> kv_b
            key = tensor.data.transpose(0, 2, 1)
            value = tensors[tensor.name.replace("attn_k_b", "attn_v_b")].data
            whole = np.concatenate([key, value], axis=1).reshape(-1, value.shape[2])
            assert key.shape[1] == nope
            writer.add_tensor(tensor.name.replace("attn_k_b", "attn_kv_b"), np.ascontiguousarray(whole))
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tuple(tensor.data.shape), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    names = {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    assert "blk.1.attn_kv_b.weight" in names and "blk.1.attn_k_b.weight" not in names
    assert read_hf_config(path) == read_hf_config(source)
    prompt = random_prompts(900, [24], seed=9)[0]
    logits = [prefill_logits(LLM(model=str(file), num_blocks=64, block_size=8), prompt) for file in (source, path)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
