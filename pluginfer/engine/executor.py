"""Executor: the driver's side of the ranks (rank 0) — starts them, sends each step, returns logits.

``start_rank`` builds one rank in order: its ``RankInfo`` (from the launcher), its ``RankPlan`` (every
choice the config leaves: checkpoint, plugins, dtypes, context; ``plan.resolve_plan``), its device backend
(which picks the rank's device), the world collective (``parallel.collective``; ``auto`` takes the
backend's ``default_collective``, or ``mpi`` under mpiexec), a check that every rank runs the same
config and plugin versions, its ``Worker`` (model shard and KV cache, the block count agreed by all
ranks). The driver then broadcasts a ``StepData`` per step; the other ranks run ``launch.run_worker``.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pluginfer.core.collective import Collective
from pluginfer.core.config import EngineConfig
from pluginfer.core.protocols import RankInfo
from pluginfer.core.registry import Registry, get_registry
from pluginfer.engine.launch import LocalWorkers, detect_launcher, rank_info
from pluginfer.engine.loader import resolve_model_path
from pluginfer.engine.lora import LoRASlotTable
from pluginfer.engine.plan import build_plugin, resolve_plan
from pluginfer.engine.step import StepData, StepDataBuilder, StepResult
from pluginfer.engine.worker import Worker

if TYPE_CHECKING:
    from pluginfer.engine.scheduler import SchedulerOutput
    from pluginfer.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class ExecutedStep:
    """A step's results on the driver: float32 logits, one row per sequence that samples, and those
    sequences; (sequence, first position, logits rows) for prompt chunks whose logprobs were asked for;
    (sequence, first position, hidden rows) for the chunks of embedding requests."""

    logits: torch.Tensor
    sample_seqs: list[Sequence]
    prompt_logits: list[tuple]
    pooled: list[tuple]
    # the last step's sampling sequences again, in order (a repeated decode step)
    same_seqs: bool
    drafts: dict[int, torch.Tensor] = field(default_factory=dict)  # seq id -> logits of its last token and drafts


@dataclass
class StartedRank:
    worker: Worker
    model_path: Path
    hf_config: dict
    max_model_len: int
    num_blocks: int
    # seconds: config (the plan: checkpoint, metadata, plugin choice), the worker's phases
    startup_times: dict[str, float]
    model: str = ""  # the model plugin's name


def start_rank(config: EngineConfig, rank: RankInfo, registry: Registry) -> StartedRank:
    """Build this rank from its plan: backend, world collective, agreement with the other ranks, worker, KV cache."""
    plan = resolve_plan(config, rank, registry)  # every choice made before anything is built
    backend = build_plugin(registry, "backend", plan.backend, config, rank)
    world = build_plugin(registry, "collective", plan.collective or backend.default_collective, config, rank)
    try:
        _check_agreement(world, config, registry, rank, plan.plugins)
        worker = Worker(plan, rank, world, backend, registry)
        num_blocks = min(world.all_gather_object(worker.max_num_blocks()))
        if worker.lora is not None and rank.pp_size > 1:  # every stage's adaptable modules, to check adapters by
            worker.lora.share_targets(world.all_gather_object(worker.lora.targets))
        worker.allocate_kv_cache(num_blocks)
    except BaseException:
        world.close()
        raise
    logger.info("rank %d/%d (tp %d/%d, pp %d/%d) loaded %s (%s) on %s: %d KV blocks of %d tokens", rank.rank,
                rank.world_size, rank.tp_rank, rank.tp_size, rank.pp_rank, rank.pp_size, plan.model_path, plan.model,
                backend.name, num_blocks, config.cache.block_size)
    return StartedRank(worker, plan.model_path, plan.hf_config, plan.max_model_len, num_blocks,
                       {"config": plan.seconds, **worker.startup_times}, plan.model)


class Executor:
    """Rank 0: its own worker plus the other ranks; one ``execute`` per engine step."""

    def __init__(self, config: EngineConfig, registry: Registry | None = None) -> None:
        registry = registry or get_registry()
        rank = rank_info(config)
        if not rank.is_driver:
            raise RuntimeError(f"rank {rank.rank} is not the driver: run it with pluginfer.engine.launch.run_worker "
                               "(`pluginfer serve` and `pluginfer generate` do so under torchrun and mpiexec)")
        self.rank, self.config = rank, config
        self.failure: str | None = None
        self._rank_lost = threading.Event()  # set with failure when a local rank's process exits
        # one collective sequence at a time: steps and keep-alive pings
        self._lock = threading.Lock()
        self._last_message = time.monotonic()
        self.local_workers = LocalWorkers(config, rank, self._lost) if rank.launcher == "spawn" else None
        try:
            started = start_rank(config, rank, registry)
        except BaseException:
            if self.local_workers is not None:
                self.local_workers.join(timeout=5)
            raise
        self.worker = started.worker
        self.model_path, self.hf_config = started.model_path, started.hf_config
        self.model_plugin, self.registry = started.model, registry
        self.max_model_len, self.num_blocks = started.max_model_len, started.num_blocks
        self.startup_times = started.startup_times
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.expert_memory = self.worker.expert_memory
        self.world: Collective = self.worker.world
        lora = LoRASlotTable(config.lora.max_loras) if config.lora.enable_lora else None
        self._steps = StepDataBuilder(config.cache.block_size, lora)
        self._closed = False
        if rank.world_size > 1:
            atexit.register(self.shutdown)  # the other ranks leave with this process
            threading.Thread(target=self._keep_alive, name="pluginfer-keepalive", daemon=True).start()

    # The rank-0 worker's parts, for tools and tests that inspect the loaded model.
    @property
    def pipeline(self) -> Any:
        return self.worker.pipeline

    @property
    def backend(self) -> Any:
        return self.worker.backend

    @property
    def quant(self) -> Any:
        return self.worker.quant

    @property
    def dtype(self) -> torch.dtype:
        return self.worker.dtype

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.worker.kv_caches

    def _lost(self, reason: str) -> None:
        self.failure = reason
        self._rank_lost.set()
        logger.error("pluginfer: %s; the engine cannot go on", reason)

    def rank_lost(self, within: float) -> str | None:
        """Why a rank was lost, waiting up to ``within`` seconds for a local rank's watcher to say so: a step that
        failed on a collective may raise before the watcher of the rank that died has reported it."""
        if self.failure is None and self.local_workers is not None and self.local_workers.processes:
            self._rank_lost.wait(within)
        return self.failure

    def _keep_alive(self) -> None:
        """Idle ranks wait in a broadcast whose timeout is ``parallel.timeout_s``: ping them meanwhile."""
        period = self.config.parallel.timeout_s / 4
        while not self._closed:
            time.sleep(min(period, 1.0))
            if self._closed or self.failure or time.monotonic() - self._last_message < period:
                continue
            with self._lock:
                if self._closed:
                    return
                try:
                    self.world.broadcast_object("ping", src=0)
                    self._last_message = time.monotonic()
                except Exception as exc:  # noqa: BLE001 - recorded; the next step raises it
                    self.failure = self.failure or f"a rank stopped answering: {exc}"
                    return

    def run_step(self, step: StepData) -> torch.Tensor:
        """Send a step built apart from the engine's to every rank and run it here; the last stage's float32
        logits. The workers' batch is then that step's: the engine's next step starts it over."""
        self._steps.forget()
        return self.run(step).logits

    def run(self, step: StepData) -> StepResult:
        """Send ``step`` to every rank and run it here; the last stage's logits and pooled hidden states."""
        with self._lock:
            if self.failure:
                raise RuntimeError(f"tensor-parallel ranks lost: {self.failure}")
            if self.rank.world_size > 1:
                try:
                    self.world.broadcast_object(step, src=0)
                except Exception as exc:
                    self.failure = self.failure or f"a rank stopped answering: {exc}"
                    raise RuntimeError(f"a rank stopped answering: {self.failure}") from exc
            self._last_message = time.monotonic()
            try:
                return self.worker.execute(step)
            except RuntimeError as exc:
                if self.failure:
                    raise RuntimeError(f"tensor-parallel ranks lost: {self.failure}") from exc
                raise

    def execute(self, scheduled: SchedulerOutput) -> ExecutedStep:
        """Run one step on every rank; what its logits and hidden rows mean."""
        plan = self._steps.build(scheduled)
        try:
            result = self.run(plan.data)
        except BaseException:
            self._steps.forget()  # the workers may hold part of this step's rows
            raise
        logits = result.logits
        pooled, at = [], 0
        if plan.pooling_rows:
            hidden = result.hidden if result.hidden is not None else torch.empty(0, self.worker.hidden_size)
            for seq, first, count in plan.pooling_rows:
                pooled.append((seq, first, hidden[at:at + count]))
                at += count
        rows, seqs, row = plan.sample_rows, plan.sample_seqs, plan.num_sampled_rows
        prompt_logits, offset = [], row
        for seq, first, count in plan.prompt_logprob_rows:
            prompt_logits.append((seq, first, logits[offset:offset + count]))
            offset += count
        drafts = {}
        for seq, count in plan.draft_rows:
            drafts[seq.seq_id] = logits[offset:offset + count]
            offset += count
        # counted, not read off the tensor: reading a tensor's shape right after the replay is slow
        if offset != row:  # rows past the sampled ones: prompt logprobs, draft checks
            logits = logits[:row]
        if len(rows) != row:  # n > 1: children sample from their parent's row
            logits = logits[torch.tensor(rows, dtype=torch.long)]
        return ExecutedStep(logits, seqs, prompt_logits, pooled, plan.repeated, drafts)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the other ranks and leave the collective (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        with self._lock:
            if self.rank.world_size > 1 and not self.failure:
                try:
                    self.world.broadcast_object(None, src=0)
                except Exception as exc:  # noqa: BLE001 - they are gone already
                    logger.warning("stopping the ranks: %s", exc)
            if self.local_workers is not None:
                self.local_workers.join(timeout)
            self.world.close()


def _check_agreement(world: Collective, config: EngineConfig, registry: Registry, rank: RankInfo,
                     plugins: list[tuple[str, str]]) -> None:
    """Ranks that disagree on the config or on plugin versions fail at start-up, naming what differs."""
    from pluginfer import __version__

    if world.world_size == 1:
        return
    settings = config.model_dump(mode="json")
    settings.pop("server", None)  # only the driver serves
    versions = {"pluginfer": __version__}
    for kind, name in plugins:
        spec = registry.resolve(kind, name)
        versions[f"{kind} {name}"] = registry.version_of(spec)
    mine = {"config": settings, "versions": versions}
    everyone = world.all_gather_object(mine)
    for other, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        for section in ("config", "versions"):
            for key in sorted(set(theirs[section]) | set(everyone[0][section])):
                ours, its = everyone[0][section].get(key), theirs[section].get(key)
                if ours != its:
                    raise RuntimeError(f"rank {other} disagrees with rank 0 on {section} {key}: "
                                       f"{_short(its)} vs {_short(ours)}; start every rank with the same "
                                       "config and the same installed plugins")


def _short(value: object) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) < 200 else hashlib.sha256(text.encode()).hexdigest()[:12]


def model_path(config: EngineConfig) -> Path:
    """The checkpoint of ``config.model`` (``LLM`` and the CLI have already made ``demo`` a directory)."""
    return resolve_model_path(config.model, config.revision)


__all__ = ["ExecutedStep", "Executor", "StartedRank", "detect_launcher", "model_path", "start_rank"]
