"""Executor: builds the plugins and the model on this rank, runs a scheduled step, samples.

Single-rank, in-process for now; tensor-parallel launchers build one Executor per rank and
broadcast each step's ForwardBatch through the Collective.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pluginfer.core.config import EngineConfig
from pluginfer.core.loader import iter_weights, read_hf_config, resolve_dtype, resolve_model_path
from pluginfer.core.protocols import BuildContext
from pluginfer.core.registry import Registry, get_registry
from pluginfer.core.runner import ModelRunner
from pluginfer.layers.context import building
from pluginfer.layers.moe import expert_memory
from pluginfer.layers.rotary import rope_parameters

if TYPE_CHECKING:
    from pluginfer.core.scheduler import SchedulerOutput
    from pluginfer.core.sequence import Sequence

logger = logging.getLogger(__name__)

_DEFAULT_CONTEXT = 2048


class Executor:
    """Everything that touches tensors: plugins, weights, KV cache, forward and sampling."""

    def __init__(self, config: EngineConfig, registry: Registry | None = None) -> None:
        self.registry = registry or get_registry()
        self.model_path = model_path(config)
        self.hf_config = read_hf_config(self.model_path)
        self.backend = self._build("backend", self._backend_name(config.backend), config)
        self.collective = self._build("collective", self._collective_name(config), config)
        self.quant = self._build("quant", self._quant_name(config.quant), self.hf_config.get("quantization_config"))
        self.dtype = resolve_dtype(config.dtype, self.hf_config)
        self.max_model_len = self._max_model_len(config)
        self.vocab_size = int(self.hf_config["vocab_size"])
        ctx = BuildContext(self.backend, self.quant, self.collective, self.dtype, self.max_model_len,
                           num_experts_offload_per_rank=config.cache.num_experts_offload_per_rank,
                           max_num_seqs=config.scheduler.max_num_seqs)
        spec = self._model_spec()
        factory = self.registry.load("model", spec.name)
        with building(ctx), torch.device(self.backend.device):
            self.pipeline = factory(self.hf_config, ctx)
        self.pipeline.eval()
        self.expert_memory = expert_memory(self.pipeline)
        offload = config.cache.num_experts_offload_per_rank
        if offload and not self.expert_memory.offloaded_experts:
            raise ValueError(f"cache.num_experts_offload_per_rank: {offload}, but {spec.name} built no "
                             "mixture-of-experts layer to offload from")
        self.pipeline.load_weights(iter_weights(self.model_path))
        if self.expert_memory.offloaded_bytes or self.expert_memory.resident_bytes:
            logger.info("experts: %d bytes resident on %s, %d bytes in the host store (%d experts), %d bytes staging",
                        self.expert_memory.resident_bytes, self.backend.name, self.expert_memory.offloaded_bytes,
                        self.expert_memory.offloaded_experts, self.expert_memory.staging_bytes)
        self.num_blocks = self._num_blocks(config)
        kv_dtype = self.dtype if config.cache.kv_cache_dtype == "auto" else resolve_dtype(config.cache.kv_cache_dtype, {})
        kv_caches = self.backend.allocate_kv_cache(self.pipeline.kv_cache_spec(), self.num_blocks,
                                                   config.cache.block_size, kv_dtype)
        self.runner = ModelRunner(self.pipeline, self.backend, kv_caches, config.cache.block_size)
        logger.info("loaded %s (%s) on %s: %d KV blocks of %d tokens", self.model_path, spec.name,
                    self.backend.name, self.num_blocks, config.cache.block_size)

    def _build(self, kind: str, name: str, argument: object) -> object:
        spec = self.registry.resolve(kind, name)
        usable, reason = self.registry.usable(spec)
        if not usable:
            raise RuntimeError(f"{kind} plugin {spec.name!r} cannot run here: {reason}")
        return self.registry.load(kind, spec.name)(argument)

    def _backend_name(self, name: str) -> str:
        if name != "auto":
            return name
        for spec in self.registry.specs("backend"):  # prefer an accelerator when one is usable
            if spec.name != "cpu" and self.registry.usable(spec)[0]:
                return spec.name
        return "cpu"

    def _collective_name(self, config: EngineConfig) -> str:
        name = config.parallel.collective
        if name == "auto":
            return "single" if config.parallel.tensor_parallel_size == 1 else "gloo"
        return name

    def _quant_name(self, name: str) -> str:
        if name != "auto":
            return name
        quant_config = self.hf_config.get("quantization_config") or {}
        if quant_config.get("checkpoint_format") == "marlin" or quant_config.get("is_marlin_format"):
            return "marlin"  # GPTQ tensors already in Marlin tiles
        return quant_config.get("quant_method", "none")

    def _model_spec(self):  # noqa: ANN202 - PluginSpec
        names = list(self.hf_config.get("architectures") or [])
        if self.hf_config.get("model_type"):
            names.append(self.hf_config["model_type"])
        if not names:
            raise ValueError(f"{self.model_path / 'config.json'} names no architectures and no model_type")
        return self.registry.resolve_any("model", names)

    def _max_model_len(self, config: EngineConfig) -> int:
        native = int(self.hf_config.get("max_position_embeddings") or _DEFAULT_CONTEXT)
        _, scaling = rope_parameters(self.hf_config)
        if scaling["rope_type"] in ("linear", "dynamic"):  # as vLLM: these stretch the native context
            native = int(native * float(scaling.get("factor", 1.0)))
        if config.max_model_len is None:
            return native
        if config.max_model_len > native:
            raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({native})")
        return config.max_model_len

    def _num_blocks(self, config: EngineConfig) -> int:
        cache = config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = self.pipeline.kv_cache_spec().bytes_per_token(self.dtype) * cache.block_size
        budget = self.backend.kv_cache_budget_bytes(cache.kv_cache_memory, cache.kv_cache_fraction)
        blocks_per_seq = -(-self.max_model_len // cache.block_size)
        useful = blocks_per_seq * config.scheduler.max_num_seqs  # more could never be used at once
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 1:
            raise ValueError(f"cache.kv_cache_memory: {budget} bytes hold no KV block ({per_block} bytes each)")
        return int(num_blocks)

    def execute(self, scheduled: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence], list[tuple]]:
        """Run one step: float32 logits, one row per sequence that samples, and those sequences;
        then (sequence, first position, logits rows) for prompt chunks whose logprobs were asked for."""
        self.runner.copy_blocks(scheduled.block_copies)
        batch = self.runner.build_batch(scheduled.scheduled)
        logits = self.runner.execute(batch)
        rows: list[int] = []
        seqs: list[Sequence] = []
        row = 0
        for item in scheduled.scheduled:
            if item.sample_for:
                rows.extend([row] * len(item.sample_for))
                seqs.extend(item.sample_for)
                row += 1
        prompt_logits, offset = [], row
        for seq, first, count in batch.extras["prompt_logprob_rows"]:
            prompt_logits.append((seq, first, logits[offset:offset + count]))
            offset += count
        logits = logits[:row]
        if len(rows) != logits.shape[0]:  # n > 1: children sample from their parent's row
            logits = logits[torch.tensor(rows, dtype=torch.long)]
        return logits, seqs, prompt_logits


def model_path(config: EngineConfig) -> Path:
    if config.model == "demo":
        from pluginfer.demo.model import ensure_demo_model

        return ensure_demo_model()
    return resolve_model_path(config.model, config.revision)
