"""LoRA adapters against transformers + peft (and sentence-transformers with an adapter loaded): greedy tokens of
each adapter and of the base, alone and mixed; logits, beams, embeddings and scores under adapters."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.checkpoints import greedy, hf_greedy, random_prompts, save_hf_model
from tests.conftest import TINY_LLAMA

peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> LoraConfig keywords: every projection; attention only with rsLoRA; the MLP only
    "all": dict(r=4, lora_alpha=8, target_modules=ALL_TARGETS),
    "attn": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"], use_rslora=True),
    "mlp": dict(r=2, lora_alpha=16, target_modules=["gate_proj", "down_proj"]),
}
MAX_TOKENS = 12


def save_adapter(base: torch.nn.Module, out: Path, seed: int, **config: object) -> torch.nn.Module:
    """A peft adapter with random (non-zero) A and B on a copy of ``base``, saved to ``out``; the peft model."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():  # peft's non-default init is small: make each adapter change the greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(str(out))
    return model.eval()


@pytest.fixture(scope="module", params=[("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {})], ids=["llama", "qwen2"])
def lora_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               tiny_tokenizer_dir: Path) -> tuple:
    arch, extra = request.param
    root = tmp_path_factory.mktemp(f"lora_{arch}")
    base = save_hf_model(arch, {**TINY_LLAMA, **extra}, root / "base", tiny_tokenizer_dir)
    peft_models = {name: save_adapter(base, root / name, seed, **config)
                   for seed, (name, config) in enumerate(ADAPTERS.items(), start=1)}
    return root, base, peft_models


def make_llm(root: Path, **kwargs: object):
    from pluginfer import LLM

    settings = dict(enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64, block_size=4)
    return LLM(str(root / "base"), **{**settings, **kwargs})


@pytest.mark.slow
def test_each_adapter_and_the_base_alone_and_mixed(lora_setup: tuple) -> None:
    from pluginfer.engine.lora import LoRARequest

    root, base, peft_models = lora_setup
    prompts = random_prompts(base.config.vocab_size, [7, 5, 9, 6], seed=3)
    expected = {None: [hf_greedy(base, p, MAX_TOKENS) for p in prompts]}
    for name, model in peft_models.items():
        expected[name] = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
        assert expected[name] != expected[None], f"adapter {name} does not change the greedy tokens"
    requests = {name: LoRARequest(name, i, str(root / name)) for i, name in enumerate(ADAPTERS, start=1)}
    llm = make_llm(root)
    try:
        for name in [None, *ADAPTERS]:  # alone: every prompt with one adapter (three adapters through two slots)
            outputs = llm.generate(prompts, greedy(MAX_TOKENS), lora_request=requests.get(name))
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected[name], name
        # mixed: the base and two adapters in one step, one per prompt
        names = [None, "all", "attn", None]
        outputs = llm.generate(prompts, greedy(MAX_TOKENS), lora_request=[requests.get(n) for n in names])
        assert [list(o.outputs[0].token_ids) for o in outputs] == [expected[n][i] for i, n in enumerate(names)]
        # three adapters wanted at once with two slots: the third waits for a slot, tokens unchanged
        names = ["mlp", "all", "attn", "mlp"]
        outputs = llm.generate(prompts, greedy(MAX_TOKENS), lora_request=[requests[n] for n in names])
        assert [list(o.outputs[0].token_ids) for o in outputs] == [expected[n][i] for i, n in enumerate(names)]
    finally:
        llm.close()


def mixed_batch(lora_setup: tuple, seed: int) -> tuple[list, list, list]:
    """(prompts, peft's greedy tokens, requests): the base and each adapter, one prompt each, in one batch."""
    from pluginfer.engine.lora_request import LoRARequest

    root, base, peft_models = lora_setup
    prompts = random_prompts(base.config.vocab_size, [7, 5, 9, 6], seed=seed)
    names = [None, "all", "attn", "mlp"]
    want = [hf_greedy(base if n is None else peft_models[n], p, MAX_TOKENS) for n, p in zip(names, prompts)]
    return prompts, want, [None if n is None else LoRARequest(n, i, str(root / n)) for i, n in enumerate(names)]


@pytest.mark.slow
def test_tensor_parallel_2_adapters_equal_peft(lora_setup: tuple) -> None:
    """Two ranks, each holding its shard of every adapter (B by outputs on column-parallel layers, A by inputs on
    row-parallel ones): greedy tokens of each adapter, of ranks 4, 8 and 2 mixed with the base in one batch."""
    root, _, _ = lora_setup
    prompts, want, requests = mixed_batch(lora_setup, seed=4)
    with make_llm(root, max_loras=3, tensor_parallel_size=2, dtype="float32") as llm:
        outputs = llm.generate(prompts, greedy(MAX_TOKENS), lora_request=requests)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want


@pytest.mark.slow
def test_pipeline_parallel_2_adapters_equal_peft(lora_setup: tuple) -> None:
    """Two stages, each loading the adapters' modules of its own layers: greedy tokens of each adapter and of the
    base in one batch equal peft's; an adapter naming a module of no layer is still refused at the driver."""
    from pluginfer.engine.lora_request import LoRARequest

    root, _, _ = lora_setup
    prompts, want, requests = mixed_batch(lora_setup, seed=6)
    with make_llm(root, max_loras=3, pipeline_parallel_size=2, dtype="float32") as llm:
        outputs = llm.generate(prompts, greedy(MAX_TOKENS), lora_request=requests)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want
        from safetensors.torch import save_file

        for name, module, inputs, message in (("bad-pp-name", "nonexistent", 64, "is not a linear layer of this model"),
                                              ("bad-pp-shape", "q_proj", 63, "q_proj")):
            bad = root / name
            if not bad.exists():
                bad.mkdir()
                (bad / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2, "peft_type": "LORA"}))
                prefix = f"base_model.model.model.layers.1.self_attn.{module}"  # layer 1: the second stage's
                save_file({f"{prefix}.lora_A.weight": torch.zeros(2, inputs),
                           f"{prefix}.lora_B.weight": torch.zeros(64, 2)}, str(bad / "adapter_model.safetensors"))
            with pytest.raises(ValueError, match=message):  # at the driver: no stage meets it
                llm.generate(prompts[:1], greedy(2), lora_request=LoRARequest(name, 9, str(bad)))
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(MAX_TOKENS),
                                                                    lora_request=requests)] == want


MOE_ADAPTERS = {  # family case -> the adapter's target modules (peft regexes)
    "qwen3-moe-norm-topk-mixed-layers": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2-moe-shared-expert": r".*(self_attn\.(q_proj|v_proj)|shared_expert\.(gate_proj|up_proj|down_proj))",
    "mixtral-8-experts-top2": ["q_proj", "o_proj"],
    "deepseek-v2-lite": ["o_proj"],
}
EXPERT_TENSORS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # transformers' fused expert parameters


def moe_case(family: str) -> tuple[str, dict]:
    from tests.models.family_cases_deepseek import CASES as DEEPSEEK
    from tests.models.family_cases_moe import CASES

    arch, overrides = {**CASES, **DEEPSEEK}[family][:2]
    return arch, overrides


def moe_adapters(family: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> tuple:
    """A MoE base and three peft adapters on it: "modules" (attention / shared expert linears), "experts" (the
    routed experts' fused tensors, gate_up with an alpha of its own, and q_proj) and "per-expert" ("experts"
    rewritten as one adapter per expert linear, as adapters of checkpoints whose experts were linears are: the
    same deltas, so peft's tokens of "experts"); (base, adapter name -> peft model, adapter name -> directory)."""
    arch, overrides = moe_case(family)
    base = save_hf_model(arch, {**TINY_LLAMA, **overrides}, tmp_path / "base", tiny_tokenizer_dir)
    models = {"modules": save_adapter(base, tmp_path / "modules", 1, r=4, lora_alpha=8,
                                      target_modules=MOE_ADAPTERS[family]),
              "experts": save_adapter(base, tmp_path / "experts", 2, r=3, lora_alpha=6, target_modules=["q_proj"],
                                      target_parameters=EXPERT_TENSORS,
                                      alpha_pattern={"mlp.experts.gate_up_proj": 12})}
    models["per-expert"] = models["experts"]
    per_expert(tmp_path / "experts", tmp_path / "per-expert", base)
    return base, models, {name: tmp_path / name for name in models}


def per_expert(source: Path, target: Path, base: torch.nn.Module) -> None:
    """``source``'s fused-tensor adapters written per expert linear, named as ``base``'s checkpoint names them."""
    from safetensors.torch import load_file, save_file

    config = base.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) \
        or config.n_routed_experts
    block, gate, up, down = ("block_sparse_moe", "w1", "w3", "w2") if config.model_type == "mixtral" else \
        ("mlp", "gate_proj", "up_proj", "down_proj")
    tensors, out = load_file(str(source / "adapter_model.safetensors")), {}
    for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
        module = key[:-len(".lora_A.weight")]
        a, b = tensors[key], tensors[module + ".lora_B.weight"]
        if ".experts" not in module:
            out[key], out[module + ".lora_B.weight"] = a, b
            continue
        prefix, rank = module.split(".mlp.experts")[0] + f".{block}.experts", a.shape[0] // experts
        for e in range(experts):
            a_e, b_e = a.reshape(experts, rank, -1)[e], b.reshape(b.shape[0], rank, experts)[:, :, e]
            halves = {gate: b_e[:b_e.shape[0] // 2], up: b_e[b_e.shape[0] // 2:]} \
                if b.shape[0] != config.hidden_size else {down: b_e}
            for name, b_half in halves.items():
                out[f"{prefix}.{e}.{name}.lora_A.weight"] = a_e.clone()
                out[f"{prefix}.{e}.{name}.lora_B.weight"] = b_half.clone()
    target.mkdir()
    save_file(out, str(target / "adapter_model.safetensors"))
    adapter_config = json.loads((source / "adapter_config.json").read_text())
    adapter_config.update(target_parameters=None, target_modules=["q_proj", gate, up, down],
                          alpha_pattern={rf"experts\.\d+\.{name}": alpha for name in (gate, up)
                                         for alpha in adapter_config["alpha_pattern"].values()})
    (target / "adapter_config.json").write_text(json.dumps(adapter_config))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MOE_ADAPTERS))
def test_adapters_on_a_mixture_of_experts_base(family: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Attention, shared-expert and routed-expert adapters on a MoE base: peft's greedy tokens for each alone and
    for all of them mixed with the base in one batch."""
    from pluginfer.engine.lora_request import LoRARequest

    base, models, paths = moe_adapters(family, tmp_path, tiny_tokenizer_dir)
    prompts = random_prompts(base.config.vocab_size, [7, 5, 8, 6], seed=3)
    want = {name: [hf_greedy(model, p, MAX_TOKENS) for p in prompts] for name, model in models.items()}
    want[None] = [hf_greedy(base, p, MAX_TOKENS) for p in prompts]
    assert want["modules"] != want[None] and want["experts"] != want[None]
    requests = {name: LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(paths.items(), start=1)}
    with make_llm(tmp_path, max_loras=3) as llm:
        for name in models:
            outputs = llm.generate(prompts, greedy(MAX_TOKENS), lora_request=requests[name])
            assert [list(o.outputs[0].token_ids) for o in outputs] == want[name], name
        names = [None, "modules", "experts", "per-expert"]
        outputs = llm.generate(prompts, greedy(MAX_TOKENS), lora_request=[requests.get(n) for n in names])
        assert [list(o.outputs[0].token_ids) for o in outputs] == [want[n][i] for i, n in enumerate(names)]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_expert_adapters_under_parallelism_equal_peft(parallel: str, tmp_path: Path,
                                                      tiny_tokenizer_dir: Path) -> None:
    """Two ranks: each expert's deltas split as its weights (tensor parallel) or loaded by the stage holding the
    layer (pipeline parallel; layer 0 dense, 1 and 3 sparse); the base and both forms mixed in one batch."""
    from pluginfer.engine.lora_request import LoRARequest

    base, models, paths = moe_adapters("qwen3-moe-norm-topk-mixed-layers", tmp_path, tiny_tokenizer_dir)
    prompts = random_prompts(base.config.vocab_size, [7, 5, 8], seed=4)
    names = [None, "experts", "per-expert"]
    want = [hf_greedy(base if n is None else models[n], p, MAX_TOKENS) for n, p in zip(names, prompts)]
    requests = [None if n is None else LoRARequest(n, i, str(paths[n])) for i, n in enumerate(names)]
    with make_llm(tmp_path, max_loras=2, dtype="float32", **{parallel: 2}) as llm:
        outputs = llm.generate(prompts, greedy(MAX_TOKENS), lora_request=requests)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want
        if parallel == "pipeline_parallel_size":  # modules of no layer of the second stage: refused at the driver
            from safetensors.torch import load_file, save_file

            for name, old, new, message in (
                    ("dense-experts", "layers.3.", "layers.2.", r"layers\.2 has no mixture-of-experts experts"),
                    ("sparse-mlp", "layers.1.self_attn.q_proj", "layers.3.mlp.gate_proj",
                     r"layers\.3\.mlp\.gate_proj is not a linear layer")):
                bad = copy_adapter(paths["experts"], tmp_path / name)
                tensors = load_file(str(bad / "adapter_model.safetensors"))
                save_file({k.replace(old, new): v for k, v in tensors.items()}, str(bad / "adapter_model.safetensors"))
                with pytest.raises(ValueError, match=message):
                    llm.generate(prompts[:1], greedy(2), lora_request=LoRARequest(name, 9, str(bad)))
            outputs = llm.generate(prompts, greedy(MAX_TOKENS), lora_request=requests)
            assert [list(o.outputs[0].token_ids) for o in outputs] == want


def test_bad_expert_adapters_are_named(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Expert adapters on a dense layer, on an expert the layer lacks, of a shape no expert tensor has, on a
    parameter that is no expert tensor, or of a rank above the limit: each refused naming it; the engine serves on."""
    from safetensors.torch import load_file, save_file

    from pluginfer.engine.lora_request import LoRARequest

    base, _, paths = moe_adapters("qwen3-moe-norm-topk-mixed-layers", tmp_path, tiny_tokenizer_dir)

    def edited(name: str, source: str, rename: tuple[str, str] = ("", ""), **config: object) -> Path:
        target = copy_adapter(paths[source], tmp_path / name, **config)
        tensors = load_file(str(target / "adapter_model.safetensors"))
        save_file({k.replace(*rename): v for k, v in tensors.items()}, str(target / "adapter_model.safetensors"))
        return target

    squeezed = edited("squeezed", "experts")
    tensors = load_file(str(squeezed / "adapter_model.safetensors"))
    tensors = {k: v[:, :-1].contiguous() if "experts.lora_A" in k else v for k, v in tensors.items()}
    save_file(tensors, str(squeezed / "adapter_model.safetensors"))
    cases = [(edited("dense", "experts", ("layers.1.", "layers.0.")), r"layers\.0 has no mixture-of-experts experts"),
             (edited("alien", "per-expert", ("experts.5.", "experts.9.")),
              r"experts\.9\.\w+_proj: not an expert projection of this model \(experts 0-5"),
             (squeezed, r"fit neither the experts' gate_up_proj nor their down_proj"),
             (edited("router", "experts", target_parameters=["mlp.gate.weight"]),
              r"target_parameters 'mlp.gate.weight': only a mixture-of-experts' fused expert tensors")]
    big = edited("big", "per-expert")
    _scale_rank(big, 16)
    cases.append((big, "rank 16 is above max_lora_rank 8"))
    with make_llm(tmp_path) as llm:
        for i, (path, message) in enumerate(cases):
            with pytest.raises(ValueError, match=message):
                llm.generate("hello", greedy(2), lora_request=LoRARequest(path.name, 10 + i, str(path)))
        good = llm.generate("hello", greedy(2), lora_request=LoRARequest("experts", 1, str(paths["experts"])))
        assert len(good[0].outputs[0].token_ids) == 2


def test_prefix_cache_is_keyed_by_adapter(lora_setup: tuple) -> None:
    """The same prompt under two adapters and the base shares no block; under one adapter it does."""
    from pluginfer.engine.lora import LoRARequest

    root, base, peft_models = lora_setup
    prompt = random_prompts(base.config.vocab_size, [13], seed=5)[0]
    llm = make_llm(root)
    try:
        manager = llm.engine.block_manager
        first = LoRARequest("all", 1, str(root / "all"))
        second = LoRARequest("attn", 2, str(root / "attn"))
        for request, hit in [(None, 0), (first, 0), (second, 0), (first, 12), (None, 12)]:
            hits = manager.prefix_cache_hits
            out = llm.generate([prompt], greedy(MAX_TOKENS), lora_request=request)[0]
            assert manager.prefix_cache_hits - hits == hit, request
            model = base if request is None else peft_models[request.lora_name]
            assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt, MAX_TOKENS)
    finally:
        llm.close()


def test_bad_adapters_are_named(lora_setup: tuple, tmp_path: Path) -> None:
    from pluginfer.engine.lora import LoRARequest

    root, _, _ = lora_setup
    llm = make_llm(root)
    try:
        def rejected(path: Path, pattern: str) -> None:
            with pytest.raises(ValueError, match=pattern):
                llm.generate("hello", greedy(2), lora_request=LoRARequest("bad", 9, str(path)))

        rejected(tmp_path / "missing", "'bad'.*adapter_config.json not found")
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text("{not json")
        (broken / "adapter_model.safetensors").write_bytes(b"")
        rejected(broken, "not JSON")
        big = copy_adapter(root / "all", tmp_path / "big", r=16)
        _scale_rank(big, 16)
        rejected(big, "rank 16 is above max_lora_rank 8")
        alien = copy_adapter(root / "all", tmp_path / "alien")
        _rename_module(alien, "q_proj", "fc_in")
        rejected(alien, "target module .*fc_in is not a linear layer")
        # nothing else was disturbed: a good adapter still runs
        good = llm.generate("hello", greedy(2), lora_request=LoRARequest("all", 1, str(root / "all")))
        assert len(good[0].outputs[0].token_ids) == 2
    finally:
        llm.close()
    from pluginfer import LLM

    plain = LLM(str(root / "base"), num_blocks=16)
    try:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            plain.generate("hello", greedy(2), lora_request=LoRARequest("all", 1, str(root / "all")))
    finally:
        plain.close()


def test_per_module_ranks_and_alphas_equal_peft(lora_setup: tuple, tmp_path: Path) -> None:
    """peft's ``rank_pattern`` and ``alpha_pattern`` (a module's rank and alpha named by its name's end or a
    regular expression): the prefill logits within 1e-4 of peft's and the greedy tokens its; patterns that do not
    parse, and a rank the weights do not hold, refused naming them; the engine serves on."""
    from pluginfer.engine.lora_request import LoRARequest
    from pluginfer.engine.step import NewRow, StepData
    from tests.checkpoints import hf_logits

    root, base, _ = lora_setup
    patterns = dict(rank_pattern={"q_proj": 2, r"layers\.1\.mlp\.down_proj": 8},
                    alpha_pattern={"v_proj": 32, r"layers\.0\.self_attn\.o_proj": 2})
    model = save_adapter(base, tmp_path / "patterned", 7, r=4, lora_alpha=8, target_modules=ALL_TARGETS, **patterns)
    ranks = {name: p.shape[0] for name, p in model.named_parameters() if "lora_A" in name}
    assert {ranks[k] for k in ranks if "q_proj" in k} == {2} and ranks[next(k for k in ranks if "1.mlp.down" in k)] == 8
    prompt = random_prompts(base.config.vocab_size, [11], seed=5)[0]
    want = hf_logits(model, prompt)
    with model.disable_adapter():
        assert (want - hf_logits(model, prompt)).abs().max() > 0.1
    request = LoRARequest("patterned", 1, str(tmp_path / "patterned"))
    with make_llm(root, dtype="float32", max_loras=1) as llm:
        got = llm.generate([prompt], greedy(MAX_TOKENS), lora_request=request)[0].outputs[0].token_ids
        assert list(got) == hf_greedy(model, prompt, MAX_TOKENS)
        logits = llm.engine.executor.run_step(StepData(  # the adapter holds the only slot, 0
            token_ids=list(prompt), num_computed_tokens=[0], block_size=4, num_new_tokens=[len(prompt)],
            seq_ids=[10**9], new_rows=[NewRow(10**9, [40, 41, 42], lora_slot=0)], reset=True))[-1]
        torch.testing.assert_close(logits, want[-1], atol=1e-4, rtol=1e-4)
        for i, (changes, message) in enumerate([
                (dict(rank_pattern=["q_proj"]), "rank_pattern .* is not an object of module patterns"),
                (dict(rank_pattern={"q_proj(": 2}), r"rank_pattern key 'q_proj\(' is not a regular expression"),
                (dict(rank_pattern={"q_proj": 0}), "rank_pattern 'q_proj': 0 is not a positive integer rank"),
                (dict(alpha_pattern={"v_proj": "big"}), "alpha_pattern 'v_proj': 'big' is not a number"),
                (dict(lora_alpha="8"), "lora_alpha '8' is not a number"),
                (dict(rank_pattern={"q_proj": 3}), r"layers\.0\.self_attn\.q_proj: lora_A holds rank 2 where "
                                                   r"adapter_config.json gives .*q_proj r 3 \(rank_pattern\)")]):
            bad = copy_adapter(tmp_path / "patterned", tmp_path / f"bad{i}", **changes)
            with pytest.raises(ValueError, match=message):
                llm.generate([prompt], greedy(2), lora_request=LoRARequest(f"bad{i}", 10 + i, str(bad)))
        again = llm.generate([prompt], greedy(MAX_TOKENS), lora_request=request)[0].outputs[0].token_ids
        assert list(again) == list(got)


def copy_adapter(source: Path, target: Path, **config_changes: object) -> Path:
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config.update(config_changes)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


def _scale_rank(path: Path, rank: int) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    for key, tensor in tensors.items():
        if "lora_A" in key:
            tensors[key] = torch.randn(rank, tensor.shape[1])
        else:
            tensors[key] = torch.randn(tensor.shape[0], rank)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _rename_module(path: Path, old: str, new: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k.replace(old, new): v for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))


def test_adapters_on_a_quantized_base(lora_setup: tuple) -> None:
    """A GGUF-quantized base (in-situ q8_0) takes the adapter through the layers' hook: the logits are peft's
    within the quantization's error, far from the base model's."""
    from pluginfer import LLM
    from pluginfer.engine.lora import LoRARequest
    from pluginfer.engine.step import NewRow, StepData
    from tests.checkpoints import hf_logits

    root, base, peft_models = lora_setup
    prompt = random_prompts(base.config.vocab_size, [9], seed=6)[0]
    want, base_logits = hf_logits(peft_models["all"], prompt)[-1], hf_logits(base, prompt)[-1]
    llm = LLM(str(root / "base"), quant="q8_0", enable_lora=True, max_lora_rank=8, num_blocks=16)
    try:
        request = LoRARequest("all", 1, str(root / "all"))
        out = llm.generate([prompt], greedy(1), lora_request=request)[0]
        assert out.outputs[0].token_ids[0] == int(want.argmax())
        # the prompt's last logits in a step of our own, its row in slot 0 (where the generate loaded the adapter)
        step = StepData(token_ids=list(prompt), num_computed_tokens=[0], block_size=16, num_new_tokens=[len(prompt)],
                        seq_ids=[10**9], new_rows=[NewRow(10**9, [15], lora_slot=0)], reset=True)
        got = llm.engine.executor.run_step(step)[-1]
    finally:
        llm.close()
    error, effect = (got - want).abs().max().item(), (want - base_logits).abs().max().item()
    assert 0 < error < 0.1 * effect, (error, effect)  # (not 0: the base weights are quantized)


def test_config_takes_lora_under_parallelism_and_refuses_bad_modules() -> None:
    from pluginfer.core.config import build_config
    from pluginfer.engine.lora_request import lora_modules

    build_config(None, model="x", **{"lora.enable_lora": True, "parallel.pipeline_parallel_size": 2})
    build_config(None, model="x", **{"lora.enable_lora": True, "parallel.tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"--lora-modules\): 'sql' is not name=path"):
        lora_modules(["sql"])
    with pytest.raises(ValueError, match="'a' is given twice"):
        lora_modules(["a=/x", "a=/y"])
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in lora_modules(["a=/x", " b = /y "])] == \
        [("a", 1, "/x"), ("b", 2, "/y")]
