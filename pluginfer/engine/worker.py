"""Worker: one rank's device backend, model shard (its pipeline stage) and KV cache.

Every rank builds one, the driver's included. A step reaches it as a ``StepData`` of host
integers; the worker applies it to its ``InputBatch`` (the rows and block tables it keeps between steps),
moves the arrays to its device, lets its backend build the attention metadata, runs
its stage (receiving the previous stage's hidden states and sending its own to the next), and the
last stage returns float32 logits (handed to the driver when the driver sits in another stage).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.collective import Collective
from pluginfer.core.device_backend import DecodeForward
from pluginfer.core.protocols import BuildContext, IntermediateTensors, RankInfo, stage_layers
from pluginfer.core.registry import Registry
from pluginfer.engine.input_batch import InputBatch
from pluginfer.engine.kv_scales import ScaleTensors, fixed_scales
from pluginfer.engine.loader import iter_weights
from pluginfer.engine.lora import ModelLoRA
from pluginfer.engine.plan import RankPlan, build_plugin
from pluginfer.engine.scoring import is_causal, scores_pooled_rows
from pluginfer.engine.step import StepData, StepResult
from pluginfer.layers.context import building
from pluginfer.layers.kv_quant import FixedScaleKVCache, check_kv_cache_dtype
from pluginfer.layers.moe import expert_memory
from pluginfer.layers.weights import LLAMA_STACKED

logger = logging.getLogger(__name__)
T = TypeVar("T")

# dtypes an intermediate tensor may have, by their code in the header sent before it
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)
# int64 slots of the header that describes a stage's intermediate tensors
_HEADER = 64


def timed_items(items: Iterable[T], spent: list[float], clock: Callable[[], float] = time.perf_counter) -> Iterator[T]:
    """``items``, adding the seconds spent producing each one to ``spent[0]`` (its consumer's own time
    is not counted): how long a lazily read checkpoint took to read, apart from what was done with it."""
    iterator = iter(items)
    while True:
        started = clock()
        try:
            item = next(iterator)
        except StopIteration:
            spent[0] += clock() - started
            return
        spent[0] += clock() - started
        yield item


def lora_slots(model: Any, config: Any, dtype: torch.dtype, backend: Any) -> ModelLoRA | None:
    """The model's LoRA slots when ``lora.enable_lora`` is set (this rank's shard of each adapter)."""
    settings = config.lora
    if not settings.enable_lora:
        return None
    routes = model.weight_routes() if hasattr(model, "weight_routes") else LLAMA_STACKED
    return ModelLoRA(model, routes, settings.max_loras, settings.max_lora_rank, dtype, backend.device,
                     backend.op("lora_sgmv"))


class Worker:
    """One rank of the model: built from its plan (every choice the config leaves, already made), the rank,
    the world collective and the backend."""

    def __init__(self, plan: RankPlan, rank: RankInfo, world: Collective, backend: Any, registry: Registry) -> None:
        config, hf_config = plan.config, plan.hf_config
        self.plan, self.config, self.rank, self.world, self.backend = plan, config, rank, world, backend
        self.max_model_len = plan.max_model_len
        self.kv_dtype = plan.kv_cache_dtype
        # set once the KV cache exists, where the backend captures decode steps
        self.decode_graphs = None
        self.inputs = InputBatch(config.cache.block_size)
        self._last_batch: ForwardBatch | None = None  # the last step's batch over the inputs' arrays (see _batch)
        # Every rank creates every group (collective semantics), then keeps its own.
        self.tp_group = world.new_group(rank.tp_groups()) if rank.world_size > 1 else world
        self.quant = build_plugin(registry, "quant", plan.quant, hf_config.get("quantization_config"))
        self.dtype = plan.dtype
        ctx = BuildContext(self.backend, self.quant, self.tp_group, self.dtype, plan.max_model_len,
                           num_experts_offload_per_rank=config.cache.num_experts_offload_per_rank,
                           max_num_seqs=config.scheduler.max_num_seqs, rank=rank)
        factory = registry.load("model", plan.model)
        # Start-up phases in seconds, logged and read by the server's start-up line: build (the modules), load
        # (reading the checkpoint), repack (copying into the layers, the quant methods' re-layout), cache.
        self.startup_times: dict[str, float] = {}
        started = time.perf_counter()
        with building(ctx), torch.device(self.backend.device):
            self.pipeline = factory(hf_config, ctx)
        self.pipeline.eval()
        check_kv_cache_dtype(self.backend, self.pipeline.kv_cache_spec(), self.kv_dtype, config.cache.kv_cache_dtype)
        self.expert_memory = expert_memory(self.pipeline)
        offload = config.cache.num_experts_offload_per_rank
        if offload and not self.expert_memory.offloaded_experts:
            raise ValueError(f"cache.num_experts_offload_per_rank: {offload}, but {plan.model} built no "
                             "mixture-of-experts layer to offload from")
        self.startup_times["build"] = time.perf_counter() - started
        started = time.perf_counter()
        # the checkpoint is read lazily: a layer is repacked as soon as its tensors arrived
        reading = [0.0]
        self.kv_scale_tensors = ScaleTensors()  # a checkpoint's k_scale/v_scale: the KV cache's, no layer's
        weights = self.kv_scale_tensors.filter(iter_weights(plan.checkpoint, allow_pickle=config.allow_pickle))
        combine = getattr(self.quant, "checkpoint_tensors", None)  # optional (QuantMethod's docstring)
        self.pipeline.load_weights(timed_items(weights if combine is None else combine(weights), reading))
        self.startup_times["load"] = reading[0]
        self.startup_times["repack"] = time.perf_counter() - started - reading[0]
        if self.expert_memory.offloaded_bytes or self.expert_memory.resident_bytes:
            logger.info("rank %d experts: %d bytes resident on %s, %d bytes in the host store (%d experts), "
                        "%d bytes staging", rank.rank, self.expert_memory.resident_bytes, self.backend.name,
                        self.expert_memory.offloaded_bytes, self.expert_memory.offloaded_experts,
                        self.expert_memory.staging_bytes)
        self.lora = lora_slots(self.pipeline, config, self.dtype, self.backend)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # A cross-encoder's or a yes/no reranker's pooled rows come back as logits (engine/scoring.py reads them).
        self.scores_pooled_rows = scores_pooled_rows(self.pipeline, config, hf_config)
        self.is_first_stage = rank.pp_rank == 0
        self.is_last_stage = rank.pp_rank == rank.pp_size - 1
        self.vocab_size = int(hf_config["vocab_size"])
        self.hidden_size = int(hf_config.get("hidden_size") or 0)

    def max_num_blocks(self) -> int:
        """KV blocks this rank's memory budget holds (the driver takes the smallest over ranks)."""
        cache, max_model_len = self.config.cache, self.max_model_len
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = self.pipeline.kv_cache_spec().bytes_per_token(self.kv_dtype) * cache.block_size
        budget = self.backend.kv_cache_budget_bytes(cache.kv_cache_memory, cache.kv_cache_fraction)
        blocks_per_seq = self.plan.max_blocks_per_seq
        max_num_seqs = self.config.scheduler.max_num_seqs
        useful = blocks_per_seq * max_num_seqs  # more could never be used at once
        num_blocks = int(min(budget // per_block, useful)) if per_block else useful  # an encoder keeps no cache
        given = "cache.kv_cache_memory (--kv-cache-memory)" if cache.kv_cache_memory is not None else \
            f"the {self.backend.name} backend's default KV cache size (set --kv-cache-memory)"
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"{given}: {budget} bytes hold {num_blocks * cache.block_size} tokens of KV cache "
                f"({per_block // cache.block_size} bytes per token), but one sequence of max_model_len "
                f"{max_model_len} needs {blocks_per_seq * cache.block_size} tokens ({blocks_per_seq * per_block} "
                "bytes): raise --kv-cache-memory or lower --max-model-len")
        why = (f"max_num_seqs {max_num_seqs} x max_model_len {max_model_len}, all the scheduler can use at once"
               if num_blocks == useful else f"what {budget} bytes from {given} hold")
        logger.info("rank %d KV cache: %d tokens (%d blocks of %d, %.1f MiB): %s", self.rank.rank,
                    num_blocks * cache.block_size, num_blocks, cache.block_size, num_blocks * per_block / 2**20, why)
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        started = time.perf_counter()
        spec = self.pipeline.kv_cache_spec()
        self.kv_caches = self.backend.allocate_kv_cache(spec, num_blocks, self.config.cache.block_size, self.kv_dtype)
        layers = stage_layers(int(self.plan.hf_config.get("num_hidden_layers") or spec.num_layers),
                              self.rank.pp_size, self.rank.pp_rank)
        scales = fixed_scales(self.plan.model_path, self.kv_scale_tensors, self.plan.hf_config, self.kv_dtype,
                              spec.num_kv_heads, layers, self.rank)
        if scales is not None:  # the checkpoint's scales per layer and KV head
            self.kv_caches = [FixedScaleKVCache(key, value, k.to(key.device), v.to(key.device))
                              for (key, value), (k, v) in zip(self.kv_caches, scales, strict=True)]
        self.pipeline.bind_kv_caches(self.kv_caches)
        self.startup_times["cache"] = time.perf_counter() - started
        capture = not self.config.enforce_eager and self.rank.pp_size == 1 and is_causal(self.pipeline)
        if capture and self.expert_memory.offloaded_experts:
            # Offloaded experts are copied in as the router picks them, a host decision every step: nothing a
            # captured step could replay (a CUDA capture refuses the copy; the cpu recorder refused it too).
            logger.info("rank %d: decode steps run eagerly: offloaded experts are brought in per step",
                        self.rank.rank)
            capture = False
        if capture:
            started = time.perf_counter()
            max_blocks = self.plan.max_blocks_per_seq
            with torch.inference_mode():
                self.decode_graphs = self.backend.capture_decode(
                    DecodeForward(self.pipeline.forward, self.pipeline.compute_logits),
                    self.config.scheduler.max_num_seqs, max_blocks, self.config.cache.block_size)
            if self.decode_graphs is not None:
                self.startup_times["graphs"] = time.perf_counter() - started
        logger.info("rank %d start-up: %s", self.rank.rank,
                    ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.startup_times.items()))

    def execute(self, step: StepData) -> StepResult | None:
        """Run this rank's part of the step; on the ranks of the last stage (and on the driver) float32
        logits of the sampled rows and the final hidden states of the pooled ones, None elsewhere.

        A decode step the backend replays (``decode_graphs``: the forward and the LM head) is run outside
        ``torch.inference_mode``, which the replay enters itself where it runs torch ops (entering it is a
        large share of a tiny model's replayed step); every other step runs in it."""
        if step.block_copies:
            with torch.inference_mode():
                self.backend.copy_blocks(self.kv_caches, step.block_copies)
        batch = self._batch(self.inputs.update(step))
        if self.lora is not None:
            with torch.inference_mode():
                self.lora.prepare(step, self.inputs.seq_ids, self.inputs.query_start_loc)
        # graphs hold no media, and replays were recorded without adapters: such steps run eagerly
        if self.decode_graphs is not None and step.is_plain_decode and not batch.multimodal \
                and not (self.lora and self.lora.mapping.active):
            logits = self.decode_graphs(batch)  # None: not a decode step the graphs cover; run it eagerly
            if logits is not None:
                return StepResult(logits)
        with torch.inference_mode():
            return self._execute_eagerly(batch)

    def _execute_eagerly(self, batch: ForwardBatch) -> StepResult | None:
        num_hidden_rows = self.inputs.num_hidden_rows
        intermediate = None
        if not self.is_first_stage:
            intermediate = self._recv_intermediate(self.rank.stage_rank(self.rank.pp_rank - 1))
        batch.attention = self.backend.prepare(batch)
        out = self.pipeline.forward(batch, intermediate)
        if not self.is_last_stage:
            self._send_intermediate(out, self.rank.stage_rank(self.rank.pp_rank + 1))
            if self.rank.is_driver:
                # the driver samples: the last stage's first rank sends it the results
                logits = self._recv_rows(self.inputs.num_logits - num_hidden_rows, self.vocab_size)
                hidden = self._recv_rows(num_hidden_rows, self.hidden_size) if num_hidden_rows else None
                return StepResult(logits, hidden)
            return None
        hidden = None
        if num_hidden_rows:
            # the pooled rows come last; they need no LM head, unless the model scores with it
            split = out.shape[0] - num_hidden_rows
            out, hidden = out[:split], out[split:]
            hidden = self.pipeline.compute_logits(hidden) if self.scores_pooled_rows else hidden.float()
        if out.shape[0] == 0:
            logits = out.new_empty(0, self.vocab_size, dtype=torch.float32)
        else:
            logits = self.pipeline.compute_logits(out)
        if self.rank.pp_size > 1 and self.rank.tp_rank == 0 and not self.rank.is_driver:
            if logits.shape[0]:
                self.world.send(logits.contiguous(), 0)
            if hidden is not None:
                self.world.send(hidden.contiguous(), 0)
        return StepResult(logits, hidden)

    def _batch(self, arrays_reused: bool) -> ForwardBatch:
        """The inputs as a ``ForwardBatch``. On the CPU a batch's tensors are the inputs' arrays: when the
        step wrote over the last step's arrays (``InputBatch.update`` says so), the last batch is handed
        again, with this step's ``max_seq_len`` and no metadata or extras of the last step."""
        batch = self._last_batch
        if arrays_reused and batch is not None:
            batch.max_seq_len, batch.attention, batch.extras = self.inputs.max_seq_len, None, {}
            batch.multimodal = self.inputs.multimodal_rows()
            return batch
        batch = self.inputs.to_batch(self.backend.device)
        self._last_batch = batch if batch.input_ids.device.type == "cpu" else None
        return batch

    def _recv_rows(self, rows: int, width: int) -> torch.Tensor:
        if rows == 0:
            return torch.empty(0, width, dtype=torch.float32, device=self.backend.device)
        buffer = torch.empty(rows, width, dtype=torch.float32, device=self.backend.device)
        return self.world.recv(buffer, (self.rank.pp_size - 1) * self.rank.tp_size)  # last stage, TP rank 0

    def _send_intermediate(self, intermediate: IntermediateTensors, dst: int) -> None:
        """A header (names, dtypes, shapes) then each tensor: stages need not know each other's shapes."""
        header: list[int] = [len(intermediate.tensors)]
        for name, tensor in intermediate.tensors.items():
            encoded = name.encode()
            header += [len(encoded), *encoded, _DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        if len(header) > _HEADER:
            raise ValueError(f"pipeline stage output needs a header of {len(header)} > {_HEADER} slots")
        self.world.send(torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64,
                                     device=self.backend.device), dst)
        for tensor in intermediate.tensors.values():
            self.world.send(tensor.contiguous(), dst)

    def _recv_intermediate(self, src: int) -> IntermediateTensors:
        header = self.world.recv(torch.empty(_HEADER, dtype=torch.int64, device=self.backend.device), src).tolist()
        count, at, tensors = header[0], 1, {}
        for _ in range(count):
            length = header[at]
            name = bytes(header[at + 1:at + 1 + length]).decode()
            at += 1 + length
            dtype, ndim = _DTYPES[header[at]], header[at + 1]
            shape = header[at + 2:at + 2 + ndim]
            at += 2 + ndim
            tensors[name] = torch.empty(shape, dtype=dtype, device=self.backend.device)
        for tensor in tensors.values():
            self.world.recv(tensor, src)
        return IntermediateTensors(tensors)
