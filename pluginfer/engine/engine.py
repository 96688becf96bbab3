"""LLMEngine: add requests, call step(), read outputs. One schedule -> forward -> sample per step."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pluginfer.core.batch import TOKEN_TYPE_SHIFT
from pluginfer.core.config import EngineConfig
from pluginfer.core.protocols import MultiModalProcessor, MultiModalPrompt
from pluginfer.engine.client import EngineStats, ModelInfo
from pluginfer.engine.detokenizer import IncrementalDetokenizer
from pluginfer.engine.executor import ExecutedStep, Executor
from pluginfer.engine.generation_config import sampling_defaults
from pluginfer.engine.kv_cache import BlockManager
from pluginfer.engine.launch import serve_if_worker
from pluginfer.engine.loader import check_tokenizer_files
from pluginfer.engine.lora import read_adapter
from pluginfer.engine.lora_request import LoRARequest, lora_modules
from pluginfer.engine.outputs import CompletionOutput, RequestOutput
from pluginfer.engine.pooling import PoolingParams, PoolingState, is_backbone_only, read_pooler_config
from pluginfer.engine.prompts import record_prompt_logprobs, split_prompt
from pluginfer.engine.sampler import Sampler
from pluginfer.engine.scheduler import Scheduler, SchedulerOutput
from pluginfer.engine.scoring import is_causal, read_scorer, scores_pooled_rows
from pluginfer.engine.sequence import FinishReason, SamplingParams, Sequence
from pluginfer.engine.speculation import build_proposer
from pluginfer.engine.stopping import check_stop
from pluginfer.engine.structured import GrammarCompiler, accept_token
from pluginfer.text.tokenizer import TokenizerBuild, eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    error: str | None = None
    done: set[int] = field(default_factory=set)


class LLMEngine:
    """Continuous batching over one model; not thread-safe (AsyncEngine wraps it in one thread)."""

    def __init__(self, config: EngineConfig,
                 receive_tokenizer: Callable[[], Any] | None = None) -> None:
        """``receive_tokenizer``: where this engine's tokenizer comes from instead of being built here, called in a
        thread while the weights load (the engine core process takes its server's); None from it, and the
        tokenizer is loaded here after the weights. One rank only."""
        self.config = config
        # ranks other than 0 (torchrun, mpiexec) serve the driver and exit here
        serve_if_worker(config)
        check_tokenizer_files(config.tokenizer or config.model)  # before the weights load and the cache is taken
        # A GGUF file's tokenizer is built in a thread while the weights load (its build holds the interpreter,
        # the load's reads and native repacks release it); other tokenizers load after the weights, and so does
        # any with more than one rank (spawned ranks are forked with a preexec_fn, unsafe beside a thread).
        tokenizer_path = config.tokenizer or config.model
        one_rank = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size == 1
        if receive_tokenizer is not None and not one_rank:
            raise ValueError("receive_tokenizer is for an engine on one rank")
        building = TokenizerBuild(tokenizer_path, receive_tokenizer) if receive_tokenizer is not None else \
            TokenizerBuild(tokenizer_path) if one_rank and TokenizerBuild.applies(tokenizer_path) else None
        try:
            self.executor = Executor(config)
        except BaseException:
            if building is not None:
                # the engine's error is the one reported; the thread ends before it is
                building.join()
            raise
        started = time.perf_counter()
        self.tokenizer = building.result() if building is not None else None
        if self.tokenizer is not None:
            logger.info("tokenizer %s in %.2f s beside the weights' load; %.2f s waited for it after them",
                        "taken" if building.received else "built", building.seconds, time.perf_counter() - started)
        else:
            self.tokenizer = load_tokenizer(config.tokenizer or self.executor.model_path)
        # Start-up phases in seconds: the executor's (config, build, load, repack, cache) and the tokenizer (what
        # the start-up waited for it once the executor was built: all of its load, or what of a build beside
        # the weights' load was left).
        self.startup_times = {**self.executor.startup_times, "tokenizer": time.perf_counter() - started}
        self.model_path = self.executor.model_path
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_path, self.executor.hf_config)
        self.sampling_defaults = sampling_defaults(config.sampling, self.model_path)  # every field set
        self.max_model_len = self.executor.max_model_len
        self.block_manager = BlockManager(self.executor.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   *build_proposer(config), vocab_size=self.executor.vocab_size,
                                   max_loras=config.lora.max_loras if config.lora.enable_lora else 0)
        self._checked_adapters: set[bytes] = set()  # adapters read and fitted to the model once
        for adapter in lora_modules(config.lora.lora_modules):  # served from the start: refused at start-up
            self.check_lora(adapter)
        self.sampler = Sampler(self.executor.vocab_size, self.eos_token_ids, seed=config.seed)
        self.grammars = GrammarCompiler(self.tokenizer, self.executor.vocab_size, self.eos_token_ids)
        pipeline, hf_config = self.executor.pipeline, self.executor.hf_config
        self.pooler = read_pooler_config(self.executor.model_path, hf_config, config.pooling)
        # A checkpoint without an LM head (an embedding model's bare decoder) only embeds.
        self.can_generate = not is_backbone_only(hf_config) and pipeline.can_generate
        # False: an encoder, which reads each prompt whole in one step
        self.is_causal = is_causal(pipeline)
        self.scorer = read_scorer(pipeline, config, hf_config, self.tokenizer, self.executor.model_path)
        self.scores = scores_pooled_rows(pipeline, config, hf_config)  # pooled rows are scored, never embedded
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.step_count = 0
        self.num_accepted_tokens = 0  # draft tokens the model agreed with, since the start
        self._fail_on_token = config.testing.fail_step_on_token_id
        # the checkpoint's multimodal processor plugin (None: the model takes text only)
        factory = self.executor.registry.multimodal_processor(self.executor.hf_config.get("architectures") or [])
        self._media: MultiModalProcessor | None = factory(str(self.model_path), self.executor.hf_config,
                                                          self.tokenizer) if factory is not None else None

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, lora_request: LoRARequest | None = None) -> str:
        """Queue a prompt (text or token ids, or vLLM's dict: ``{"prompt" or "prompt_token_ids": ...,
        "multi_modal_data": {"image": ...}}``) to generate from, or to embed with ``PoolingParams``;
        returns its request id. ``lora_request``: the adapter it runs with (``lora.enable_lora``)."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            self.check_lora(lora_request)
        if isinstance(params, PoolingParams):
            return self._add_embedding(prompt, params, request_id, lora_request)
        if not self.can_generate:
            names = self.executor.hf_config.get("architectures")
            raise ValueError(f"this checkpoint is a bare decoder without an LM head (architectures {names}): "
                             "it serves embeddings only")
        prompt, media = split_prompt(prompt)
        text, token_ids = self._tokenize(prompt)
        media = self._process_media(token_ids, media) if media else None
        if media is not None:
            token_ids = media.token_ids
        vocab = self.executor.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"SamplingParams.logit_bias: token ids must be below the vocabulary size {vocab}")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise ValueError(f"SamplingParams.stop_token_ids: token ids must be below the vocabulary size {vocab}")
        seqs = [Sequence(request_id, token_ids, params, index=i, arrival_step=self.step_count, lora=lora_request)
                for i in range(params.n)]
        if media is not None:
            # the model reads its inputs; the blocks of its prompt are named under its media
            for seq in seqs:
                seq.multimodal, seq.cache_salt = media.inputs, media.content_hash
        if params.structured_outputs is not None:
            # a copy of the cached matcher (the server compiles it first)
            for seq in seqs:
                seq.grammar = self.grammars.matcher(params.structured_outputs)
        detokenizers = [IncrementalDetokenizer(self.tokenizer, token_ids, params) for _ in seqs]
        self._requests[request_id] = _Request(request_id, text, token_ids, seqs, detokenizers)
        self.scheduler.add_request(seqs)
        return request_id

    def check_lora(self, request: LoRARequest) -> None:
        """Read an adapter and fit it to the model once; a ValueError naming what is wrong with it."""
        if request.key in self._checked_adapters:
            return
        model_lora = self.executor.worker.lora
        if model_lora is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: LoRA is not enabled "
                             "(lora.enable_lora, --enable-lora)")
        model_lora.resolve(read_adapter(request), request)
        self._checked_adapters.add(request.key)

    def _add_embedding(self, prompt: str | list[int], params: PoolingParams, request_id: str,
                       lora_request: LoRARequest | None) -> str:
        """An embedding or score request: its prompt is prefilled like any other (under its adapter, if any),
        pooled, and nothing is sampled.

        A score request's prompt is the pair's token ids, token types in their high bits (``encode_pair``)."""
        prompt, media = split_prompt(prompt)
        if media:
            raise ValueError("multi_modal_data: embeddings and scores are made from text only")
        if params.task == "score":
            self.scorer.check()
            pooling = PoolingState(self.scorer.method, False, whole_prompt=not self.is_causal,
                                   score=self.scorer.score_of())
        else:
            if self.scores:
                raise ValueError("this model scores pairs of texts (a cross-encoder or a reranker); it does not "
                                 "embed")
            self.pooler.check(params)
            if isinstance(prompt, str):
                prompt = self.pooler.default_prompt + prompt
            pooling = PoolingState(self.pooler.method, self.pooler.normalize, params.dimensions,
                                   whole_prompt=not self.is_causal)
        text, token_ids = self._tokenize(prompt, token_types=params.task == "score")
        budget = self.config.scheduler.max_num_batched_tokens
        if not self.is_causal and len(token_ids) > budget:
            raise ValueError(f"prompt has {len(token_ids)} tokens; an encoder reads a prompt in one step, and a "
                             f"step holds at most scheduler.max_num_batched_tokens {budget}")
        seq = Sequence(request_id, token_ids, SamplingParams(max_tokens=1), arrival_step=self.step_count,
                       lora=lora_request)
        seq.pooling = pooling
        detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, seq.params)
        self._requests[request_id] = _Request(request_id, text, token_ids, [seq], [detokenizer])
        self.scheduler.add_request([seq])
        return request_id

    def _process_media(self, token_ids: list[int], data: dict) -> MultiModalPrompt:
        """The prompt with its media readied by the model plugin's multimodal processor."""
        if self._media is None:
            names = self.executor.hf_config.get("architectures")
            raise ValueError(f"multi_modal_data: this model (architectures {names}) takes text only")
        unknown = sorted(set(data) - set(self._media.modalities))
        if unknown:
            raise ValueError(f"multi_modal_data: {', '.join(map(repr, unknown))} is not taken by this model "
                             f"(it takes: {', '.join(self._media.modalities)})")
        return self._media.process(token_ids, data)

    def _tokenize(self, prompt: str | list[int], token_types: bool = False) -> tuple[str | None, list[int]]:
        """``token_types``: the ids may carry token types above ``TOKEN_TYPE_SHIFT`` (a score request's pair)."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            token_ids, text = list(prompt), None
            vocab = self.executor.vocab_size
            mask = (1 << TOKEN_TYPE_SHIFT) - 1 if token_types else -1
            bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or not 0 <= t & mask < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if not token_ids:
            raise ValueError("prompt is empty")
        return text, token_ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.abort(request_id)
        return self._output(request)

    @property
    def failure(self) -> str | None:
        """Why the engine cannot go on (a rank was lost), or None."""
        return self.executor.failure

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def model_info(self) -> ModelInfo:
        """What a client of this engine knows of its model (``pluginfer.engine.client``)."""
        return ModelInfo(model_path=str(self.executor.model_path), max_model_len=self.max_model_len,
                         vocab_size=self.executor.vocab_size, eos_token_ids=frozenset(self.eos_token_ids),
                         num_blocks=self.block_manager.num_blocks, block_size=self.block_manager.block_size,
                         modalities=tuple(self._media.modalities) if self._media is not None else ())

    def stats(self) -> EngineStats:
        """The gauges and counters now; call it from the thread that steps the engine."""
        scheduler, manager = self.scheduler, self.block_manager
        return EngineStats(num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
                           kv_cache_usage=manager.usage, num_free_blocks=manager.num_free_blocks,
                           num_blocks=manager.num_blocks, num_preemptions=scheduler.num_preemptions,
                           prefix_cache_queries=manager.prefix_cache_queries,
                           prefix_cache_hits=manager.prefix_cache_hits, spec_drafts=scheduler.num_drafts,
                           spec_draft_tokens=scheduler.num_draft_tokens,
                           spec_accepted_tokens=self.num_accepted_tokens)

    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """One engine step; returns the outputs of the requests that progressed or finished
        (``only_finished``: of those that finished, the others' outputs are not built: ``LLM.generate``
        reads nothing else, and building one copies its tokens every step)."""
        self.step_count += 1
        scheduled = self.scheduler.schedule()
        touched: dict[str, _Request] = {}
        for seq in scheduled.rejected:
            request = self._requests.get(seq.request_id)
            if request is not None:
                request.error = seq.error
                touched[seq.request_id] = request
        if scheduled.scheduled:
            try:
                self._run(scheduled, touched)
            except Exception as exc:
                if self.executor.rank_lost(within=1.0):  # a rank was lost: nothing can run any more
                    raise
                self._fail_step(scheduled, exc, touched)
        for seq in self.scheduler.update(scheduled):
            if seq.request_id in self._requests:
                touched[seq.request_id] = self._requests[seq.request_id]
        outputs = []
        for request in touched.values():
            if only_finished and not all(seq.is_finished for seq in request.seqs):
                self._flush_finished(request)  # what _output would do for its finished completions (n > 1)
                continue
            output = self._output(request)
            if output.finished:
                del self._requests[request.request_id]
            outputs.append(output)
        return outputs

    def _run(self, scheduled: SchedulerOutput, touched: dict[str, _Request]) -> None:
        """Forward the scheduled rows, sample, and append each sampled token."""
        if self._fail_on_token is not None and any(
                self._fail_on_token in row.seq.token_ids[row.seq.num_computed_tokens:][:row.num_new_tokens]
                for row in scheduled.scheduled):
            raise RuntimeError(f"injected fault: the step computes token {self._fail_on_token} "
                               "(testing.fail_step_on_token_id)")
        executed = self.executor.execute(scheduled)
        for seq, first, rows in executed.prompt_logits:
            record_prompt_logprobs(seq, first, rows)
            touched[seq.request_id] = self._requests[seq.request_id]
        for seq, first, hidden in executed.pooled:
            seq.pooling.add(first, hidden)
        for item in scheduled.scheduled:
            seq = item.seq
            if seq.pooling is not None and seq.num_computed_tokens + item.num_new_tokens == len(seq):
                seq.pooling.finish()  # the whole prompt is read: the embedding is done
                seq.finish(FinishReason.STOP)
                touched[seq.request_id] = self._requests[seq.request_id]
        seqs = executed.sample_seqs
        if executed.drafts:
            self._verify(executed, scheduled, touched)
        elif seqs:
            sampled = self.sampler(executed.logits, seqs, same_seqs=executed.same_seqs)
            for seq, token_id, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs):
                request = self._requests[seq.request_id]
                touched[seq.request_id] = request
                self._append(request, seq, token_id, logprobs)

    def _verify(self, executed: ExecutedStep, scheduled: SchedulerOutput, touched: dict[str, _Request]) -> None:
        """Sample each sequence's tokens position by position, as decoding one at a time would, while they
        equal its drafts: position ``j``'s logits are exact once the drafts before it were accepted. A
        sequence's last token (its mismatch, or the one after all its drafts) is always kept. Each kept
        token is sampled once, from the model's distribution, with the sequence's own generator: the output
        is the one without speculation (Leviathan et al.'s rejection sampling, for a proposer whose draft
        distribution puts all its mass on one token)."""
        rows = {row.seq.seq_id: row for row in scheduled.scheduled if row.draft_token_ids}
        seqs, logits, drafts = executed.sample_seqs, executed.logits, executed.drafts
        active, position = list(range(len(seqs))), 0
        while active:
            picked = []
            for i in active:
                row = rows.get(seqs[i].seq_id)
                checks = row is not None and position < len(row.draft_token_ids)
                picked.append(drafts[seqs[i].seq_id][position] if checks else logits[i])
            sampled = self.sampler(torch.stack(picked), [seqs[i] for i in active])
            still = []
            for i, token_id, logprobs in zip(active, sampled.token_ids, sampled.logprobs):
                seq = seqs[i]
                request = self._requests[seq.request_id]
                touched[seq.request_id] = request
                self._append(request, seq, token_id, logprobs)
                row = rows.get(seq.seq_id)
                if row is not None and position < len(row.draft_token_ids) and \
                        token_id == row.draft_token_ids[position] and not seq.is_finished:
                    row.num_accepted += 1
                    still.append(i)
            active, position = still, position + 1
        self.num_accepted_tokens += sum(row.num_accepted for row in rows.values())

    def _fail_step(self, scheduled: SchedulerOutput, exc: Exception, touched: dict[str, _Request]) -> None:
        """A step raised: fail the requests it ran (their blocks are freed), log it once, and go on."""
        failed = {row.seq.request_id for row in scheduled.scheduled}
        logger.error("an engine step failed (%s: %s); failing its %d request(s) and going on",
                     type(exc).__name__, exc, len(failed), exc_info=exc)
        message = f"the engine step running this request failed: {type(exc).__name__}: {exc}"
        for request_id in failed:
            request = self._requests.get(request_id)
            if request is None:
                continue
            self.scheduler.abort(request_id, FinishReason.FAILED, message)
            for seq in request.seqs:
                if seq.is_finished and seq.finish_reason is not FinishReason.FAILED:
                    seq.finish(FinishReason.FAILED, message)  # one that stopped in the step that failed
            request.error = message
            touched[request_id] = request

    def _append(self, request: _Request, seq: Sequence, token_id: int, logprobs: dict | None) -> None:
        seq.output_token_ids.append(token_id)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        detokenizer = request.detokenizers[seq.index]
        detokenizer.push(token_id)  # decoded now only if stop strings need it
        reason = check_stop(seq, token_id, detokenizer, self.eos_token_ids, self.max_model_len)
        if seq.grammar is not None and accept_token(seq.grammar, token_id):
            reason = FinishReason.STOP  # the grammar is complete: nothing may follow
        if reason is not None:
            seq.finish(reason)

    def _flush_finished(self, request: _Request) -> None:
        """Flush the held-back text of the request's completions that finished since the last call."""
        for seq, detokenizer in zip(request.seqs, request.detokenizers):
            if seq.is_finished and seq.index not in request.done:
                request.done.add(seq.index)
                if detokenizer.stopped_by is None:
                    detokenizer.finish()

    def _output(self, request: _Request) -> RequestOutput:
        self._flush_finished(request)
        completions = []
        for seq, detokenizer in zip(request.seqs, request.detokenizers):
            completions.append(CompletionOutput(
                index=seq.index,
                text=detokenizer.text,
                token_ids=list(seq.output_token_ids),
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            ))
        finished = all(seq.is_finished for seq in request.seqs)
        error = request.error or next((s.error for s in request.seqs if s.error), None)
        first = request.seqs[0]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished=finished, error=error, num_cached_tokens=first.num_cached_prompt_tokens,
                             prompt_logprobs=list(first.prompt_logprobs)
                             if first.params.prompt_logprobs is not None else None,
                             embedding=first.pooling.embedding if first.pooling is not None else None)

    def abort_all(self) -> None:
        for request_id in list(self._requests):
            self.abort_request(request_id)

    def shutdown(self) -> None:
        """Abort what is left and stop the other ranks (idempotent; also run at interpreter exit)."""
        self.abort_all()
        self.executor.shutdown()
