"""Deployment configuration: one pydantic model, from a YAML/JSON file and/or CLI flags."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, model_validator

# How long an idle OpenMP thread of the engine core process spins before it sleeps unless the config
# says (``server.core_spin_count``): libgomp's own default, as the offline engine runs.
DEFAULT_CORE_SPIN_COUNT = 300000


class ConfigError(ValueError):
    """An invalid configuration; the message names the field path and the reason."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ParallelConfig(_Section):
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks that split each layer.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages, each a contiguous run of layers.")
    collective: str = Field(
        "auto", description="Collective plugin: auto (the backend's default: gloo on cpu, nccl on cuda), "
                            "single, gloo, nccl, mpi, ...")
    launcher: Literal["auto", "inprocess", "spawn", "torchrun", "mpi"] = Field(
        "auto", description="Who starts the ranks: auto (torchrun's or mpiexec's environment when present, "
                            "else spawn local workers when more than one rank is asked, else inprocess).")
    master_addr: str = Field("127.0.0.1", description="Rendezvous address of spawned ranks (torchrun: MASTER_ADDR).")
    master_port: int = Field(0, ge=0, le=65535, description="Rendezvous port; 0 picks a free one.")
    timeout_s: float = Field(120.0, gt=0, description="Longest wait of a collective at start-up, per step and "
                                                      "at shutdown before a rank is declared lost.")


class CacheConfig(_Section):
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    kv_cache_memory: ByteSize | None = Field(
        None, ge=1, description="KV cache size: bytes, or text such as 2GiB or 512MB; overrides kv_cache_fraction."
    )
    kv_cache_fraction: float = Field(
        0.3, gt=0, le=0.95, description="Fraction of free device memory for the KV cache."
    )
    num_blocks: int | None = Field(None, ge=1, description="Exact number of KV blocks (tests).")
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV cache dtype; auto: the model's (float16 for a GGUF file with dtype auto, "
                            "llama.cpp's default). int8, fp8 (= fp8_e4m3), fp8_e5m2: 1-byte codes "
                            "with a float32 scale per token and KV head (the checkpoint's fixed per-head scales "
                            "when it ships them), about half a 16-bit cache's bytes.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV blocks of a shared prompt prefix.")
    num_experts_offload_per_rank: int = Field(
        0, ge=0, description="MoE experts per layer kept in host memory and brought in when routed.")


class SchedulerConfig(_Section):
    max_num_seqs: int = Field(64, ge=1, description="Sequences in one step at most.")
    max_num_batched_tokens: int = Field(2048, ge=16, description="Token budget of one step.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts over steps.")


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port; 0 picks a free one.")
    api_keys: list[str] = Field(default_factory=list,
                                description="Bearer keys the server accepts; none: no key needed.")
    served_model_name: str | None = Field(None, description="Model name clients use; default the model (a GGUF file: its stem).")
    max_waiting: int = Field(1024, ge=1, description="Queued requests before 429/503.")
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest request body (413 beyond).")
    max_logprobs: int = Field(20, ge=0, le=20, description="Most top logprobs a request may ask for.")
    max_n: int = Field(128, ge=1, description="Most choices (n) one request may ask for.")
    max_prompts: int = Field(256, ge=1, description="Most prompts in one completions request.")
    max_stop: int = Field(64, ge=0, description="Most stop strings, and most stop token ids, in one request.")
    max_stop_chars: int = Field(1024, ge=1, description="Longest stop string, in characters.")
    allowed_origins: list[str] = Field(
        default_factory=list, description="Origins browsers may call the API from (CORS); '*' for any; "
        "none by default (no CORS headers).")
    shutdown_timeout: float = Field(
        0.0, ge=0, description="On SIGTERM, seconds to let requests in flight finish (new ones get a 503) "
        "before the rest are ended; 0: end them at once.")
    access_log: bool = Field(
        True, description="One INFO line per request (method, path, status, request id, prompt and completion "
        "tokens, milliseconds) on the pluginfer.access logger.")
    reasoning_parser: str | None = Field(
        None, description="A reasoning_parser plugin (built in: deepseek_r1, qwen3): its reasoning text goes to "
                          "reasoning_content.")
    tool_call_parser: str | None = Field(
        None, description="A tool_parser plugin (built in: hermes (qwen), llama3_json, mistral, deepseek_v3 "
                          "(deepseek_v31)): reads the tool calls of tool_choice auto.")
    endpoints: list[str] = Field(
        default_factory=list, description="endpoint plugins whose HTTP routes the server adds; none by default.")
    allowed_media_domains: list[str] = Field(
        default_factory=list, description="Hosts whose http(s) image URLs chat requests may name (fetched with a "
                                          "size and time limit); none by default: only base64 data URIs.")
    media_fetch_timeout_s: float = Field(10.0, gt=0, description="Longest wait for one remote image URL.")
    allowed_local_media_path: str | None = Field(
        None, description="A directory whose files chat requests may name as file:// image URLs (symlinks "
                          "resolved, at most 20 MiB); none by default.")
    request_processors: list[str] = Field(
        default_factory=list, description="request_processor plugins run on every chat (and responses) and "
                                          "completions request, in this order; none by default.")
    strict_tool_schemas: bool = Field(
        True, description="Tool arguments (named, required) hold only the keys their schema declares: an object "
        "without additionalProperties is closed, as OpenAI and xgrammar read it; false: JSON Schema's open objects.")
    responses_store_size: int = Field(
        1024, ge=0, description="Responses kept in memory for GET /v1/responses/{id} and previous_response_id, the "
        "least recently used dropped first; 0 keeps none.")
    core_spin_count: int = Field(
        DEFAULT_CORE_SPIN_COUNT, ge=0, description="How long an idle OpenMP thread of the engine core process "
        "spins before it sleeps (libgomp's GOMP_SPINCOUNT, ~100000 a millisecond). The default, 300000 (libgomp's "
        "own, as the offline engine runs), keeps threads awake between a step's kernels and sleeps when the server idles: "
        "fastest on cores of the server's own. 0: they sleep at once (OMP_WAIT_POLICY=PASSIVE), which stays "
        "fast when other programs load the cores. OMP_WAIT_POLICY or GOMP_SPINCOUNT set in the environment win.")


# What a request that sets a sampling field gets when neither the deployment nor the model's
# generation_config.json sets it either.
BUILTIN_SAMPLING: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class SamplingDefaults(_Section):
    """Defaults of requests that set none; an unset field takes the model's generation_config.json, else the
    built-in value (``BUILTIN_SAMPLING``), as vLLM does."""

    temperature: float | None = Field(None, ge=0, description="Temperature of requests that set none; unset: "
                                      "the model's generation_config.json, else 1.0.")
    top_p: float | None = Field(None, gt=0, le=1, description="Top-p of requests that set none; unset: the "
                                "model's generation_config.json, else 1.0.")
    top_k: int | None = Field(None, ge=-1, description="Top-k of requests that set none (0 or -1: off); unset: "
                              "the model's generation_config.json, else 0.")
    min_p: float | None = Field(None, ge=0, le=1, description="Min-p of requests that set none; unset: the "
                                "model's generation_config.json, else 0.")
    repetition_penalty: float | None = Field(
        None, ge=1e-6, le=1e6, description="Repetition penalty of requests that set none; unset: the model's "
        "generation_config.json, else 1.0.")
    max_tokens: int = Field(256, ge=1, description="Tokens to generate for requests that set no limit.")

    def over(self, model: dict[str, Any]) -> SamplingDefaults:
        """Every field set: this deployment's value, else the model's (``model``: valid values read from its
        generation_config.json), else the built-in one."""
        filled = {name: value for name, value in {**BUILTIN_SAMPLING, **model}.items()
                  if getattr(self, name) is None}
        return self.model_copy(update=filled)


class SpeculativeConfig(_Section):
    """Speculative decoding: a proposer drafts tokens, one model pass checks them all (docs/speculative.md)."""

    method: str = Field("ngram", description="Proposer plugin (`pluginfer plugins`): ngram looks the last tokens "
                        "up in the prompt and output and drafts what followed them; draft_model decodes a small "
                        "model with the same tokenizer (the default when a model is given).")
    num_speculative_tokens: int = Field(..., ge=1, le=32, description="Draft tokens per step and sequence.")
    model: str | None = Field(None, description="draft_model: the draft model's checkpoint directory or .gguf file.")
    prompt_lookup_max: int = Field(4, ge=1, le=64, description="ngram: the longest suffix looked up.")
    prompt_lookup_min: int = Field(2, ge=1, le=64, description="ngram: the shortest suffix looked up.")

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.model is not None and "method" not in self.model_fields_set:
            self.method = "draft_model"
        if self.method == "draft_model" and self.model is None:
            raise ValueError("method draft_model needs model, the draft model's checkpoint")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("method ngram takes no model (the draft model's method is draft_model)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


class LoRAConfig(_Section):
    """LoRA adapters in PEFT's format, served beside the base model (docs/lora.md)."""

    enable_lora: bool = Field(False, description="Serve LoRA adapters: a request names one (as `model` on the "
                              "server, a LoRARequest offline).")
    max_loras: int = Field(1, ge=1, description="Adapters held at once (slots); sequences of more wait.")
    max_lora_rank: int = Field(16, ge=1, description="The highest adapter rank accepted.")
    lora_modules: list[str] = Field(default_factory=list, description="An adapter the server serves from the "
                                    "start, as name=path.")
    allow_runtime_lora_updating: bool = Field(
        False, description="Accept /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING).")


class TestingConfig(_Section):
    fail_step_on_token_id: int | None = Field(
        None, ge=0, description="Fault injection for tests: a step that computes this token id raises, which fails "
        "the requests of that step (a 500) while the engine goes on. Never set it in a deployment.")


QUANT_ACTIVATIONS_ENV = "PLUGINFER_QUANT_ACTIVATIONS"


def quant_activations(configured: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(``int8`` or ``float``, what chose it): ``quant_activations`` of the config, else PLUGINFER_QUANT_ACTIVATIONS,
    else the default int8; a bad value of the variable is a ConfigError naming it."""
    if configured is not None:
        return configured, "quant_activations"
    if QUANT_ACTIVATIONS_ENV not in environ:
        return "int8", "default"
    mode = environ[QUANT_ACTIVATIONS_ENV].lower()
    if mode not in ("int8", "float"):
        raise ConfigError(f"{QUANT_ACTIVATIONS_ENV}={mode!r}: expected 'int8' (the default) or 'float'")
    return mode, QUANT_ACTIVATIONS_ENV


class EngineConfig(_Section):
    model: str = Field(..., description="A Hugging Face checkpoint directory, a hub id, a .gguf file, or 'demo'.")
    tokenizer: str | None = Field(None, description="Tokenizer directory if not the model's.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    backend: str = Field("auto", description="Device backend plugin, or auto.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights and activations; auto: the checkpoint's.")
    quant: str = Field("auto", description="Quant method plugin; auto reads the checkpoint.")
    quant_activations: Literal["int8", "float"] | None = Field(
        None, description="Activations of GGUF-quantized linears on the cpu backend: int8 (quantized per block of "
        "32, as llama.cpp: fast) or float (float32 against dequantized weights: exact, as transformers); unset: "
        "PLUGINFER_QUANT_ACTIVATIONS, else int8.")
    max_model_len: int | None = Field(None, ge=1, description="Context length; default the model's.")
    seed: int = Field(0, description="Engine seed.")
    allow_pickle: bool = Field(
        False, description="Read a checkpoint that has only pickle weights (.bin, .pt) with "
        "torch.load(weights_only=True); refused otherwise, since a pickle can run code.")
    threads: int | None = Field(
        None, ge=1, description="CPU threads of each rank's compute on the cpu backend (its torch ops and native "
        "kernels); default: PLUGINFER_CPU_THREADS if set, else every core, divided among the ranks on one machine.")
    enforce_eager: bool = Field(
        False, description="Run every step eagerly: no replays of decode steps (the cuda backend captures CUDA "
        "graphs of them at bucketed batch sizes, the cpu backend records each batch size's first decode step "
        "and replays it in one native call, otherwise).")
    pooling: Literal["last", "mean", "cls"] | None = Field(
        None, description="How embeddings pool the hidden states, for a checkpoint without sentence-transformers "
        "files (then L2-normalized, as vLLM does) or in place of its Pooling module's mode.")
    score_tokens: list[str] | None = Field(
        None, description="Serve a causal LM as a reranker scored from two tokens' logits at the last position: "
        "the 'false' token, then the 'true' one (Qwen3-Reranker: --score-tokens no --score-tokens yes); score = "
        "sigmoid(logit(true) - logit(false)).")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    speculative_config: SpeculativeConfig | None = Field(None, description="Speculative decoding; off when unset.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    testing: TestingConfig = Field(default_factory=TestingConfig)


def _format_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(root)"
        got = f" (got {item['input']!r})" if "input" in item and not isinstance(item["input"], dict) else ""
        lines.append(f"{path}: {item['msg']}{got}")
    return "invalid config: " + "; ".join(lines)


def _deep_merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{'cache.block_size': 32} -> {'cache': {'block_size': 32}}."""
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as exc:  # the parser's own message says where
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def build_config(file: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """File first, then overrides (dotted keys like ``cache.block_size`` or nested dicts)."""
    data = read_config_file(file) if file else {}
    data = _deep_merge(data, nest({k: v for k, v in overrides.items() if v is not None}))
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


def config_schema() -> dict[str, Any]:
    return EngineConfig.model_json_schema()
