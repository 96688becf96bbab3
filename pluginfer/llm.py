"""The offline Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

from pluginfer.cli.options import dotted_keywords
from pluginfer.core.config import build_config
from pluginfer.engine.beam_search import Beam, BeamSearchParams
from pluginfer.engine.engine import LLMEngine
from pluginfer.engine.lora_request import LoRARequest
from pluginfer.engine.outputs import RequestOutput
from pluginfer.engine.pooling import PoolingParams
from pluginfer.engine.scoring import encode_pair, score_pairs, uses_token_types
from pluginfer.engine.sequence import SamplingParams
from pluginfer.text.image_parts import extract_images
from pluginfer.text.tokenizer import render_chat

# text, token ids, or {"prompt"|"prompt_token_ids": ..., "multi_modal_data": ...}
Prompt = str | list[int] | dict


@dataclass(frozen=True)
class ScoreOutput:
    """One pair's score (``LLM.score``) and the pair's token ids (token types in their high bits)."""

    score: float
    prompt_token_ids: list[int]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching."""

    def __init__(self, model: str, config_file: str | None = None, **kwargs: Any) -> None:
        """``model``: a checkpoint directory, ``.gguf`` file, hub id or ``"demo"``; ``kwargs``: any
        ``EngineConfig`` field by its name (``block_size=32``), its dotted path or its flag's name."""
        from pluginfer.demo.model import with_demo_model

        self.config = with_demo_model(build_config(config_file, model=model, **dotted_keywords(kwargs)))
        self.engine = LLMEngine(self.config)

    def close(self) -> None:
        """Stop the other ranks of a tensor/pipeline-parallel engine (also done at interpreter exit)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no SamplingParams: temperature, top_p, top_k, min_p and
        repetition_penalty from the config's ``sampling`` section, else the model's generation_config.json,
        else SamplingParams' own (as vLLM's); the rest SamplingParams' defaults."""
        defaults = self.engine.sampling_defaults
        return SamplingParams(temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k,
                              min_p=defaults.min_p, repetition_penalty=defaults.repetition_penalty)

    @staticmethod
    def _adapters(lora_request: LoRARequest | list[LoRARequest | None] | None, count: int) -> list[LoRARequest | None]:
        """``lora_request`` as one adapter (or None) per prompt: the one given for all, or the list, of ``count``."""
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * count
        if len(loras) != count:
            raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
        return loras

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Outputs in prompt order (``params`` None: ``get_default_sampling_params()``). A request that cannot
        run (e.g. too long) gets finish_reason "error". ``lora_request``: the LoRA adapter of every prompt, or
        one per prompt (None: the base model), with ``LLM(..., enable_lora=True)``."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = params if isinstance(params, list) else \
            [params or self.get_default_sampling_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        loras = self._adapters(lora_request, len(prompts))
        ids: list[str] = []
        try:
            for prompt, p, lora in zip(prompts, params_list, loras):
                ids.append(self.engine.add_request(prompt, p, lora_request=lora))
        except BaseException:
            for request_id in ids:
                # a bad prompt fails the call without leaving the others queued
                self.engine.abort_request(request_id)
            raise
        return self._run(ids)

    def embed(self, prompts: Prompt | list[Prompt], params: PoolingParams | None = None,
              lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One embedding per prompt (``output.embedding``, a list of floats), in prompt order, pooled as the
        checkpoint's sentence-transformers files say; the prompts run batched through the engine like any
        other. A prompt that cannot run (e.g. longer than the context) raises ValueError. ``lora_request``: as
        ``generate``'s."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or PoolingParams()
        loras = self._adapters(lora_request, len(prompts))
        ids: list[str] = []
        try:
            for prompt, lora in zip(prompts, loras):
                ids.append(self.engine.add_request(prompt, params, lora_request=lora))
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        outputs = self._run(ids)
        for index, output in enumerate(outputs):
            if output.error or output.embedding is None:
                raise ValueError(f"prompt {index}: {output.error or 'no embedding was produced'}")
        return outputs

    def score(self, text_1: str | list[str], text_2: str | list[str],
              lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[ScoreOutput]:
        """How well each pair of texts matches, as vLLM's ``LLM.score``: one ``text_1`` against each ``text_2``,
        or the two lists side by side. A cross-encoder or a causal LM served with ``score_tokens`` scores
        (``pluginfer/engine/scoring.py``); any other model raises ValueError saying so. ``lora_request``: the
        adapter of every pair, or one per pair."""
        self.engine.scorer.check()
        token_types = uses_token_types(self.engine.executor.hf_config)
        prompts = [encode_pair(self.engine.tokenizer, first, second, token_types)
                   for first, second in score_pairs(text_1, text_2)]
        outputs = self.embed(prompts, PoolingParams(task="score"), lora_request)
        return [ScoreOutput(output.embedding[0], output.prompt_token_ids) for output in outputs]

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[list[Beam]]:
        """The ``beam_width`` best continuations of each prompt, best first, found as transformers'
        ``generate(num_beams=...)`` finds them (``pluginfer/engine/beam_search.py``). ``lora_request``: as
        ``generate``'s, the adapter of every prompt or one per prompt."""
        from pluginfer.engine.beam_search import run_beam_search

        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if any(isinstance(p, dict) for p in prompts):
            raise ValueError("beam_search takes text or token-id prompts (no multi_modal_data)")
        tokenizer = self.engine.tokenizer
        token_ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]  # type: ignore[union-attr]
        return run_beam_search(self.generate, token_ids, params, self.engine.eos_token_ids, self.engine.max_model_len,
                               decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                               lora_requests=self._adapters(lora_request, len(token_ids)))

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the model's chat template. A message's
        ``image_url`` content parts (base64 data URIs) go to a model that takes images.

        ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) are rendered into the prompt by the
        template (a ``ValueError`` if it does not read them); the answer is plain text, as the model writes a
        call (the server's ``--tool-call-parser`` turns it into ``tool_calls``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        requests: list[Prompt] = []
        for conv in conversations:
            conv, images = extract_images(conv)  # type: ignore[arg-type]
            text = render_chat(self.engine.tokenizer, conv, tools=tools, **(chat_template_kwargs or {}))
            token_ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
            requests.append({"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}} if images
                            else token_ids)
        return self.generate(requests, params, lora_request=lora_request)

    def _run(self, request_ids: SequenceABC[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        try:
            while len(finished) < len(wanted):
                for output in self.engine.step(only_finished=True):
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return [finished[request_id] for request_id in request_ids]
