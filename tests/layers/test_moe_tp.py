"""Mixture-of-experts layers and whole MoE models under tensor parallelism: 2 thread ranks against 1 rank.

Each rank (``pluginfer.testing.threads.run_ranks``) builds the same layer or model in its own build context,
loads the same full weights (each keeps its slice) and runs the same batch; the result must equal the
single-rank one. Tolerance (float32): tensor parallelism only changes the order of sums (each rank sums its
part of the intermediate dimension or of the heads, the all-reduce adds the parts), so the largest
difference must stay within 1e-5 of the largest magnitude of the single-rank result. The ranks themselves
agree bit for bit (the thread collective sums in rank order on every rank).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext, RankInfo
from pluginfer.core.registry import get_registry
from pluginfer.engine.loader import iter_weights, read_hf_config
from pluginfer.layers.context import building
from pluginfer.layers.mlp import GatedMLP
from pluginfer.layers.moe import FusedExperts, SparseMoeBlock, expert_weight_names
from pluginfer.layers.router import RouterSpec, route
from pluginfer.layers.weights import load_named_weights
from pluginfer.models import deepseek
from pluginfer.quant import unquantized
from pluginfer.testing.threads import run_ranks
from tests.backends.paged import paged_batch
from tests.layers.conftest import PANELS_AVAILABLE, backend_with

REL = 1e-5  # max |TP - 1 rank| <= REL * max |1 rank| (float32, sums in another order)
HIDDEN, INTERMEDIATE = 64, 48

# building(ctx) is one process-wide context, not per thread: thread ranks build one at a time (a build
# makes no collective call, so nothing waits on another rank meanwhile).
BUILD_LOCK = threading.Lock()


@pytest.fixture(autouse=True)
def one_torch_thread() -> None:
    """The thread ranks share torch's intra-op pool (and the machine's cores): one thread each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Rank:
    """A rank of a world nobody talks to: enough to build layers that reject a split at construction."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def rank_context(collective: object, dtype: torch.dtype = torch.float32, max_model_len: int = 128,
                 offload: int = 0, max_num_seqs: int = 1, native: bool = True) -> BuildContext:
    """One tensor-parallel rank's build context: its own cpu backend, the collective's rank and size."""
    world = collective.world_size
    return BuildContext(backend=backend_with(native), quant=unquantized.build(), collective=collective, dtype=dtype,
                        max_model_len=max_model_len, num_experts_offload_per_rank=offload,
                        max_num_seqs=max_num_seqs, rank=RankInfo(rank=collective.rank, world_size=world,
                                                                 tp_size=world))


def build_on(ctx: BuildContext, make: Callable[[], nn.Module]) -> nn.Module:
    with BUILD_LOCK, building(ctx):
        return make()


def on_ranks(world_size: int, fn: Callable[[object], object]) -> list:
    """``fn(collective)`` per rank: the single-rank collective for one rank, thread ranks otherwise."""
    return [fn(single.build())] if world_size == 1 else run_ranks(world_size, fn)


def assert_tp_matches(results: list[torch.Tensor], reference: torch.Tensor, rel: float = REL) -> None:
    for rank, out in enumerate(results[1:], start=1):
        assert torch.equal(out, results[0]), f"rank {rank} differs from rank 0"
    assert results[0].shape == reference.shape and results[0].dtype == reference.dtype
    diff = (results[0].double() - reference.double()).abs().max().item()
    bound = rel * reference.abs().max().item()
    assert diff <= bound, f"tensor-parallel result off by {diff:.3g} (bound {bound:.3g})"


# --- MoE blocks as each family builds them ---------------------------------------------------------------

def _deepseek_router(**fields: object) -> RouterSpec:
    return deepseek.router_spec(deepseek.with_defaults(fields))


# case: (experts, router, shared experts (multiples of the expert size))
BLOCKS = {
    "mixtral": (8, RouterSpec(top_k=2, renormalize=True), 0),
    "qwen3-moe": (8, RouterSpec(top_k=2, renormalize=False), 0),
    "deepseek-v2-group-limited": (8, _deepseek_router(
        architectures=["DeepseekV2ForCausalLM"], num_experts_per_tok=2, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5), 2),
    "deepseek-v3-noaux-tc": (8, _deepseek_router(
        architectures=["DeepseekV3ForCausalLM"], num_experts_per_tok=3, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5), 1),
}
DENSE_ROUTES = ((".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1))


class Holder(nn.Module):
    def __init__(self, **modules: nn.Module) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)


def block_weights(num_experts: int, router: RouterSpec, shared: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    weights = {"moe.gate.weight": randn(num_experts, HIDDEN, scale=1.0)}
    if router.correction_bias:
        weights["moe.gate.e_score_correction_bias"] = randn(num_experts)
    for e in range(num_experts):
        for name, shape in (("gate_proj", (INTERMEDIATE, HIDDEN)), ("up_proj", (INTERMEDIATE, HIDDEN)),
                            ("down_proj", (HIDDEN, INTERMEDIATE))):
            weights[f"moe.experts.{e}.{name}.weight"] = randn(*shape)
    if shared:
        size = shared * INTERMEDIATE
        weights["moe.shared_experts.gate_proj.weight"] = randn(size, HIDDEN)
        weights["moe.shared_experts.up_proj.weight"] = randn(size, HIDDEN)
        weights["moe.shared_experts.down_proj.weight"] = randn(HIDDEN, size)
    return weights


def run_block(case: str, collective: object, x: torch.Tensor, offload: int = 0, native: bool = True,
              max_num_seqs: int = 1) -> tuple[torch.Tensor, nn.Module, dict[str, int]]:
    num_experts, router, shared = BLOCKS[case]
    ctx = rank_context(collective, offload=offload, native=native, max_num_seqs=max_num_seqs)
    model = build_on(ctx, lambda: Holder(moe=SparseMoeBlock(
        num_experts, router.top_k, HIDDEN, INTERMEDIATE, router.renormalize, router=router,
        shared_experts=GatedMLP(HIDDEN, shared * INTERMEDIATE) if shared else None,
        size_field="moe_intermediate_size")))
    routes = expert_weight_names(num_experts, "gate_proj", "up_proj", "down_proj") + DENSE_ROUTES
    load_named_weights(model, block_weights(num_experts, router, shared).items(), stacked=routes)
    calls_before = dict(getattr(collective, "calls", {}))
    out = model.moe(x)
    calls = {k: v - calls_before.get(k, 0) for k, v in getattr(collective, "calls", {}).items()}
    return out, model, calls


@pytest.mark.parametrize("case", list(BLOCKS))
@pytest.mark.parametrize("offload", [0, 3])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_moe_block_on_two_ranks_equals_one_rank(case: str, offload: int, native: bool) -> None:
    x = torch.randn(33, HIDDEN, generator=torch.Generator().manual_seed(1))
    reference = on_ranks(1, lambda c: run_block(case, c, x, native=native)[0])[0]
    results = on_ranks(2, lambda c: run_block(case, c, x, offload=offload, native=native))
    assert_tp_matches([out for out, _, _ in results], reference)
    for _, model, calls in results:
        experts = model.moe.experts
        assert calls == {"all_reduce": 1}, "routed and shared experts are summed in one all-reduce"
        assert experts.shard_size == INTERMEDIATE // 2
        assert experts.num_resident == BLOCKS[case][0] - offload
        assert tuple(experts.host_gate_up.shape) == (offload, INTERMEDIATE, HIDDEN)
        assert tuple(experts.host_down.shape) == (offload, HIDDEN, INTERMEDIATE // 2)
        if experts.packed is None:
            assert tuple(experts.gate_up_proj.shape) == (experts.num_resident, INTERMEDIATE, HIDDEN)
        assert experts.layout == (experts.dense.packed_layout(torch.empty(1, 1)) or "checkpoint")
        assert experts.layout == "panels" or not (native and PANELS_AVAILABLE)
    transfers = [model.moe.experts.transfers for _, model, _ in results]
    assert transfers[0] == transfers[1] and (transfers[0] > 0) == (offload > 0), "same routing on every rank"


@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_one_token_and_onednn_layout(max_num_seqs: int) -> None:
    """Decode-sized input; with the native panels off and a batching engine the experts use oneDNN's layout."""
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(2))
    case = "deepseek-v3-noaux-tc"
    reference = on_ranks(1, lambda c: run_block(case, c, x, native=False, max_num_seqs=max_num_seqs)[0])[0]
    results = on_ranks(2, lambda c: run_block(case, c, x, native=False, max_num_seqs=max_num_seqs)[0])
    assert_tp_matches(results, reference)


def test_fused_experts_alone_reduce_their_output() -> None:
    """FusedExperts outside a block (``reduce_results`` by default) all-reduce their own output."""
    num_experts, top_k = 6, 2
    weights = block_weights(num_experts, RouterSpec(top_k), 0)
    router = weights.pop("moe.gate.weight")
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3))
    topk_weights, topk_ids = route(x @ router.T, top_k, renormalize=True)

    def run(collective: object) -> torch.Tensor:
        ctx = rank_context(collective)
        model = build_on(ctx, lambda: Holder(moe=Holder(experts=FusedExperts(num_experts, HIDDEN, INTERMEDIATE))))
        load_named_weights(model, weights.items(),
                           stacked=expert_weight_names(num_experts, "gate_proj", "up_proj", "down_proj"))
        out = model.moe.experts(x, topk_weights, topk_ids)
        if collective.world_size > 1:
            assert collective.calls == {"all_reduce": 1}
        return out

    assert_tp_matches(on_ranks(2, run), on_ranks(1, run)[0])


def test_stacked_checkpoint_tensors_are_sliced_per_rank() -> None:
    """Checkpoints that store ``[experts, 2 * intermediate, hidden]`` / ``[experts, hidden, intermediate]``
    load into the same per-rank slices as per-expert tensors (and as one expert's whole tensors)."""
    num_experts = 4
    generator = torch.Generator().manual_seed(5)
    gate_up = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=generator)
    down = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=generator)
    per_expert = {}
    for e in range(num_experts):
        gate, up = gate_up[e].split(INTERMEDIATE)
        per_expert |= {f"moe.experts.{e}.gate_proj.weight": gate, f"moe.experts.{e}.up_proj.weight": up,
                       f"moe.experts.{e}.down_proj.weight": down[e]}

    def run(collective: object) -> None:
        ctx = rank_context(collective, native=False)
        stacked = build_on(ctx, lambda: FusedExperts(num_experts, HIDDEN, INTERMEDIATE, num_offloaded=1))
        stacked.weight_loader(stacked.gate_up_proj, gate_up)
        stacked.weight_loader(stacked.down_proj, down)
        split = build_on(ctx, lambda: Holder(moe=Holder(experts=FusedExperts(num_experts, HIDDEN, INTERMEDIATE,
                                                                             num_offloaded=1))))
        load_named_weights(split, per_expert.items(),
                           stacked=expert_weight_names(num_experts, "gate_proj", "up_proj", "down_proj"))
        whole = build_on(ctx, lambda: FusedExperts(num_experts, HIDDEN, INTERMEDIATE, num_offloaded=1))
        for e in range(num_experts):  # (expert, None): one expert's whole tensor
            whole.weight_loader(whole.gate_up_proj, gate_up[e], (e, None))
            whole.weight_loader(whole.down_proj, down[e], (e, None))
        half = INTERMEDIATE // 2
        rows = slice(collective.rank * half, (collective.rank + 1) * half)
        for e in range(num_experts):
            for layer in (stacked, split.moe.experts, whole):
                got_gate_up, got_down = (layer._expert_view(p, e) for p in (layer.gate_up_proj, layer.down_proj))
                assert torch.equal(got_gate_up, torch.cat([gate_up[e, :INTERMEDIATE][rows],
                                                           gate_up[e, INTERMEDIATE:][rows]]))
                assert torch.equal(got_down, down[e][:, rows])
        with pytest.raises(ValueError, match=r"does not match expected \(4, 96, 64\)"):
            stacked.weight_loader(stacked.gate_up_proj, gate_up[:, :INTERMEDIATE])

    on_ranks(2, run)


# --- sizes that do not split --------------------------------------------------------------------------------

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=100, max_position_embeddings=64)
NOT_SPLITTING = {
    "mixtral": ({**TINY, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                 "intermediate_size": 30}, "intermediate_size 30"),
    "qwen3-moe": ({**TINY, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                   "moe_intermediate_size": 30, "head_dim": 16}, "moe_intermediate_size 30"),
    "deepseek-v2": ({**TINY, "architectures": ["DeepseekV2ForCausalLM"], "n_routed_experts": 4,
                     "moe_intermediate_size": 30, "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": None,
                     "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}, "moe_intermediate_size 30"),
    "deepseek-v3-dense-layer": ({**TINY, "architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 4,
                                 "moe_intermediate_size": 32, "intermediate_size": 30, "first_k_dense_replace": 1,
                                 "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": None,
                                 "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
                                "intermediate_size 30"),
}


@pytest.mark.parametrize("family", list(NOT_SPLITTING))
def test_intermediate_size_that_does_not_split_names_field_and_sizes(family: str) -> None:
    config, field = NOT_SPLITTING[family]
    factory = get_registry().load("model", get_registry().resolve_any("model", config["architectures"]).name)
    ctx = rank_context(Rank(0, 4))
    with pytest.raises(ValueError, match=rf"config.json: {field} is not divisible by the tensor-parallel size 4"):
        build_on(ctx, lambda: factory(config, ctx))


def test_fused_experts_that_do_not_split_name_the_field() -> None:
    ctx = rank_context(Rank(1, 4))
    with pytest.raises(ValueError, match="moe_intermediate_size 30 is not divisible by the tensor-parallel size 4"):
        build_on(ctx, lambda: FusedExperts(4, HIDDEN, 30, size_field="moe_intermediate_size"))


# --- whole models: prefill and decode logits at TP=2 against TP=1 ------------------------------------------

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, moe_intermediate_size=32, num_hidden_layers=3)
# family: (architecture, config overrides); DeepSeek cases as in tests/models/family_cases_deepseek.py.
MODELS = {
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-moe-dense-layer": ("Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16,
        "norm_topk_prob": True, "num_hidden_layers": 3, "mlp_only_layers": [0]}),
    "deepseek-v2-group-limited": ("DeepseekV2ForCausalLM", {
        **MLA, "q_lora_rank": 24, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2,
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.5}),
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", {
        **MLA, "q_lora_rank": None, "n_routed_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "topk_method": "greedy", "first_k_dense_replace": 1}),
    "deepseek-v3-yarn": ("DeepseekV3ForCausalLM", {
        **MLA, "q_lora_rank": 24, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                            "beta_fast": 32, "beta_slow": 1}}),
}
BLOCK_SIZE, NUM_BLOCKS = 4, 24
PROMPT_LENS = (5, 11, 17)


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               tiny_tokenizer_dir: Path) -> tuple[str, Path, int]:
    from tests.checkpoints import save_hf_model
    from tests.models.family_cases_deepseek import randomise_correction_bias

    arch, overrides = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(arch, {**BASE, **overrides}, path, tiny_tokenizer_dir)
    if "V3" in arch:  # transformers starts e_score_correction_bias at zeros: give the router a real one
        randomise_correction_bias(model)
        model.save_pretrained(path, safe_serialization=True)
    return request.param, path, model.config.vocab_size


def load_model(path: Path, collective: object, offload: int = 0) -> tuple[nn.Module, BuildContext]:
    """The pipeline the engine would build on this rank: registry factory, streamed weights, bound caches."""
    config = read_hf_config(path)
    registry = get_registry()
    factory = registry.load("model", registry.resolve_any("model", config["architectures"]).name)
    ctx = rank_context(collective, max_model_len=64, offload=offload)
    model = build_on(ctx, lambda: factory(config, ctx)).eval()
    model.load_weights(iter_weights(path, progress=False))
    caches = ctx.backend.allocate_kv_cache(model.kv_cache_spec(), NUM_BLOCKS, BLOCK_SIZE, ctx.dtype)
    bind = getattr(model, "bind_kv_caches", None)
    if bind is not None:
        bind(caches)
    else:  # as ModelRunner binds them
        layers = [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "backend")]
        assert len(layers) == len(caches)
        for layer, cache in zip(layers, caches):
            layer.kv_cache = cache
    return model, ctx


def prefill_and_decode(model: nn.Module, backend: object, prompts: list[list[int]],
                       next_tokens: list[int]) -> torch.Tensor:
    """Logits of every prompt position (one prefill of all prompts), then of one decode step each."""
    tables, free = [], list(range(NUM_BLOCKS))[::-1]  # blocks handed out from the end
    for prompt in prompts:
        tables.append([free.pop(0) for _ in range(-(-(len(prompt) + 1) // BLOCK_SIZE))])
    lens = [len(p) for p in prompts]
    logits = []
    for seq_lens, query_lens, ids in ((lens, lens, [t for p in prompts for t in p]),
                                      ([n + 1 for n in lens], [1] * len(prompts), next_tokens)):
        batch = paged_batch(backend, tables, seq_lens, query_lens, BLOCK_SIZE)
        batch.input_ids = torch.tensor(ids)
        batch.logits_indices = torch.arange(batch.num_tokens)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(batch)))
    return torch.cat(logits)


def test_model_logits_on_two_ranks_equal_one_rank(checkpoint: tuple[str, Path, int]) -> None:
    name, path, vocab = checkpoint
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    next_tokens = torch.randint(10, vocab, (len(prompts),), generator=generator).tolist()

    def run(collective: object, offload: int = 0) -> torch.Tensor:
        model, ctx = load_model(path, collective, offload)
        experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
        assert experts and all(m.tp_size == collective.world_size and m.num_offloaded == offload for m in experts)
        return prefill_and_decode(model, ctx.backend, prompts, next_tokens)

    reference = on_ranks(1, run)[0]
    assert reference.shape == (sum(PROMPT_LENS) + len(prompts), vocab)
    assert_tp_matches(on_ranks(2, run), reference)
    if name in ("mixtral", "deepseek-v2-group-limited"):  # each rank offloads the last 2 experts' slices
        assert_tp_matches(on_ranks(2, lambda c: run(c, offload=2)), reference)
    if name in ("mixtral", "deepseek-v3-yarn"):
        # 4 ranks: one attention head each, mixtral's 2 KV heads held by 2 ranks each, and the tokenizer's
        # vocabulary (not a multiple of 4) padded in the last rank's embedding and LM head slices.
        assert vocab % 4
        assert_tp_matches(on_ranks(4, run), reference)
