"""The four protocols a plugin implements: ModelPipeline, QuantMethod, DeviceBackend, Collective.

A plugin registers a *spec* (see ``hookspecs.PluginSpec``) whose ``factory`` points at a
callable building one of these. The core only ever talks to plugins through them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from pluginfer.core.kv_quant import SCALE_BYTES, is_quantized

if TYPE_CHECKING:
    from pluginfer.core.batch import ForwardBatch


@dataclass(frozen=True)
class DecodeForward:
    """What a worker hands ``DeviceBackend.capture_decode``: the model's forward and its LM head, called as
    one (a decode batch -> float32 logits of its sampled rows). A backend that captures the whole step
    calls it as it is; one that may fail to capture the head (the cpu backend's recorder refuses a
    soft-capping ``tanh``) captures ``forward`` and runs ``compute_logits`` after it."""

    forward: Any  # (batch: ForwardBatch) -> hidden states of the sampled rows
    compute_logits: Any  # (hidden) -> float32 logits

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        return self.compute_logits(self.forward(batch))


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token costs in the paged cache: per layer, K of ``head_dim`` and V of ``v_head_dim``.

    ``value_in_key``: no value is stored; the value is the first ``value_in_key`` features of the
    cached key. Multi-head latent attention (DeepSeek) caches one "head" per token, the compressed
    latent followed by the rope key, and reads the latent back as the value.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    value_in_key: int | None = None

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        if self.value_in_key is not None:
            width = self.head_dim
        else:
            width = self.head_dim + (self.v_head_dim if self.v_head_dim is not None else self.head_dim)
        heads = self.num_kv_heads * (1 if self.value_in_key is not None else 2)
        scale_bytes = SCALE_BYTES * heads if is_quantized(dtype) else 0  # a quantized row's float32 scale
        return self.num_layers * (self.num_kv_heads * width * dtype.itemsize + scale_bytes)


@dataclass(frozen=True)
class RankInfo:
    """Where one process sits among the ranks of a deployment; what launchers produce.

    Global rank ``r`` is tensor-parallel rank ``r % tp_size`` of pipeline stage ``r // tp_size``.
    ``local_rank`` picks the device on this machine. ``master_addr`` / ``master_port`` are the
    rendezvous of collectives that need one (``torch.distributed``); port 0 means "rank 0 picks a
    free port and hands it to the ranks it spawns".
    """

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    launcher: str = "inprocess"

    def __post_init__(self) -> None:
        if self.tp_size * self.pp_size != self.world_size:
            raise ValueError(f"parallel: tensor_parallel_size {self.tp_size} x pipeline_parallel_size "
                             f"{self.pp_size} must equal the world size {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world_size} ranks")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def tp_groups(self) -> list[list[int]]:
        """Global ranks of every tensor-parallel group (one per pipeline stage)."""
        return [[stage * self.tp_size + i for i in range(self.tp_size)] for stage in range(self.pp_size)]

    def pp_groups(self) -> list[list[int]]:
        """Global ranks of every pipeline (one per tensor-parallel rank)."""
        return [[stage * self.tp_size + i for stage in range(self.pp_size)] for i in range(self.tp_size)]

    def stage_rank(self, stage: int) -> int:
        """Global rank of this rank's tensor-parallel peer in pipeline stage ``stage``."""
        return stage * self.tp_size + self.tp_rank


@dataclass(frozen=True)
class ShardSpec:
    """How a linear layer's weight is split across tensor-parallel ranks; ``create_weights`` gets it.

    ``dim``: 0 when the outputs are split (column parallel), 1 when the inputs are (row parallel),
    None when every rank holds the whole weight. ``rank`` / ``size``: the tensor-parallel rank and
    world. ``output_sizes``: the full (all ranks) sizes of the projections fused in this layer
    (q/k/v, gate/up), whose shards are each split separately; ``kv_replicas``: ranks that hold the
    same key/value heads when there are fewer KV heads than ranks (QKV layers only).
    """

    dim: int | None = None
    rank: int = 0
    size: int = 1
    output_sizes: tuple[int, ...] = ()
    kv_replicas: int = 1

    @property
    def is_split(self) -> bool:
        return self.dim is not None and self.size > 1

    def narrow(self, loaded: torch.Tensor, axis: int, part: int) -> torch.Tensor:
        """This rank's ``part``-sized slice of ``loaded`` along ``axis`` (which must hold ``part * size``)."""
        if loaded.dim() <= axis or loaded.shape[axis] != part * self.size:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not have {part * self.size} "
                             f"along axis {axis} to split over {self.size} tensor-parallel ranks")
        return loaded.narrow(axis, self.rank * part, part)


@dataclass
class BuildContext:
    """What a model factory receives besides the HF config: the plugins it builds on.

    ``collective`` is this rank's tensor-parallel group (its rank and world size are the TP rank and
    size); ``rank`` says where the process sits in the whole deployment, pipeline stage included.
    """

    backend: DeviceBackend
    quant: QuantMethod
    collective: Collective
    dtype: torch.dtype
    max_model_len: int
    # Experts per MoE layer kept in host memory and copied to the device when routed (cache config).
    num_experts_offload_per_rank: int = 0
    # Sequences one step may batch (scheduler config): a weight layout may be chosen for it.
    max_num_seqs: int = 1
    rank: RankInfo = RankInfo()

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers this rank's pipeline stage holds (contiguous, earlier stages get the extra)."""
        return stage_layers(num_layers, self.rank.pp_size, self.rank.pp_rank)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    if pp_size > num_layers:
        raise ValueError(f"parallel.pipeline_parallel_size {pp_size} is larger than the model's "
                         f"num_hidden_layers {num_layers}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: named hidden-state tensors ``[num_tokens, ...]``."""

    tensors: dict[str, torch.Tensor]


@runtime_checkable
class ModelPipeline(Protocol):
    """One model family. Factory signature: ``factory(hf_config: dict, ctx: BuildContext)``.

    The pipeline is a ``torch.nn.Module`` built from ``pluginfer.layers``; its linear layers
    take their parameters and matmul from ``ctx.quant`` and their attention from
    ``ctx.backend``. The factory raises ``ValueError`` naming the config field for any
    combination it does not implement (never ignore a field silently).

    Pipeline parallelism: with ``ctx.rank.pp_size > 1`` the factory builds only the layers of
    ``ctx.stage_layers(num_layers)`` (the first stage also the embedding, the last the final norm
    and LM head), or raises ``ValueError`` naming ``parallel.pipeline_parallel_size`` if it cannot.

    Optional attributes (API 5; the engine reads them with these defaults where a pipeline has none):
    ``is_causal`` (True): False for an encoder whose attention is bidirectional within each sequence; the engine
    then reads each prompt whole in one step (never chunked, never from the prefix cache), and ``kv_cache_spec``
    may say ``num_layers`` 0 (no cache is allocated). ``num_labels`` (0): a sequence classifier's label count
    (a cross-encoder: 1); a score request's pooled row (the first token's final hidden state) goes through
    ``compute_logits``, which returns ``[rows, num_labels]``, and the pipeline serves scores, not embeddings.
    """

    # API 3. False when the pipeline was loaded without an LM head (an embedding model's bare decoder): the
    # engine then only embeds with it, and ``compute_logits`` is never called. Set once loading is done.
    can_generate: bool

    def kv_cache_spec(self) -> KVCacheSpec:
        """Shape of the paged cache this model (this pipeline stage's layers) needs."""

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hand each attention layer of this stage its (key, value) cache, in layer order.

        ``len(kv_caches) == kv_cache_spec().num_layers``; raise ``ValueError`` otherwise.
        """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (checkpoint name, tensor) pairs as they stream from disk.

        Map names to parameters and call each parameter's ``weight_loader`` (which shards
        for tensor parallelism and hands the tensor to the quant method). Raise ``KeyError``
        naming the tensor for an unexpected one and for any parameter left unloaded.
        """

    def forward(self, batch: ForwardBatch,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """Run the flat batch; return hidden states of the rows in ``batch.logits_indices``.

        Under pipeline parallelism every stage but the first receives the previous stage's
        ``intermediate`` instead of embedding ``batch.input_ids``, and every stage but the last
        returns its ``IntermediateTensors`` (the same names and shapes on every step).
        """

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to float32 logits over the whole vocabulary."""


@dataclass
class MultiModalPrompt:
    """A prompt with its images (or other media) made ready for the model: ``token_ids`` with each
    placeholder expanded to as many tokens as the media fill, ``inputs`` the model's own data (it comes back
    as ``ForwardBatch.multimodal[row]``, so it must pickle for other ranks), ``content_hash`` a digest of
    the media (prompts with different media never share prefix-cache blocks)."""

    token_ids: list[int]
    inputs: Any
    content_hash: bytes


@runtime_checkable
class MultiModalProcessor(Protocol):
    """A model's preprocessing of media (a ``MultimodalProcessorSpec``'s factory, API 5), run where requests arrive.

    Factory signature: ``factory(model_path: str, hf_config: dict, tokenizer) -> MultiModalProcessor``.
    """

    modalities: tuple[str, ...]  # the ``multi_modal_data`` keys it takes, e.g. ("image",)

    def process(self, token_ids: list[int], data: dict[str, Any]) -> MultiModalPrompt:
        """The tokenized prompt and its ``multi_modal_data`` (a key: one item or a list); ``ValueError``
        naming the item for media it cannot read, too many items, or placeholders that do not match."""


@runtime_checkable
class QuantMethod(Protocol):
    """One weight format for linear layers. Factory: ``factory(quant_config: dict | None)``.

    A linear layer calls ``create_weights`` once, lets the loader fill the registered
    parameters through their ``weight_loader``, calls ``process_weights_after_loading``
    (repacking), then ``apply`` at every forward.

    Optional class attribute ``holds_experts`` (True): mixture-of-experts layers hold each expert's
    projections as layers of this method (its ``weight_loader`` installed by ``create_weights``), not as
    stacked float weights; a format whose checkpoint tensors stay in their own layout (GGUF's blocks).
    """

    name: str

    def create_weights(
        self, layer: torch.nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
        shard: ShardSpec = ShardSpec(),
    ) -> None:
        """Register the parameters this format keeps for an ``output_size x input_size`` weight.

        Sizes are this rank's shard; ``shard`` says how the full weight is split across
        tensor-parallel ranks (raise ``ValueError`` naming the sizes for a split the format cannot
        make, e.g. a quantization group or block cut in two). Each parameter gets ``output_dim`` /
        ``input_dim`` attributes (which axis is sharded) so layers can load slices into it; a
        format that installs its own ``weight_loader`` slices with ``shard`` itself.
        """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack or convert after every shard arrived (no-op for plain weights)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for this format."""

    def vocab_table(self, loaded: Any, start: int, rows: int, dtype: torch.dtype, backend: Any) -> Any:
        """Rows ``start:start + rows`` of a ``[vocab, hidden]`` checkpoint tensor kept in this format (API 3).

        ``layers.embedding`` calls it when a checkpoint hands the embedding or the LM head a tensor that is
        not a dense ``torch.Tensor`` (a GGUF file's quantized blocks). Return a ``VocabTable`` of those rows
        in the format's own layout (raise ``ValueError`` naming what it cannot hold), or None: this format
        keeps no vocabulary tables, and loading stops naming the tensor's type and the method.
        """


class VocabTable(Protocol):
    """Rows of a ``[vocab, hidden]`` table held in a quant method's own format (``QuantMethod.vocab_table``):
    one table serves a tied embedding and LM head."""

    rows: int  # the rows held

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` row indices (``0 <= id < rows``) to ``[n, hidden]`` in the model dtype: those rows only."""

    def logits(self, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``hidden @ table.T + bias``: ``[..., hidden]`` to ``[..., rows]``."""


@runtime_checkable
class DeviceBackend(Protocol):
    """One device. Factory: ``factory(config: EngineConfig, rank: RankInfo)``.

    The spec's ``check`` tells whether the device is usable on this machine. ``rank.local_rank``
    picks this rank's device; ``rank.local_world_size`` ranks share the machine (and its cores).
    ``core.backend_base.BaseDeviceBackend`` implements every member over a ``KernelTable``: subclass it and
    override what the device does differently. ``pluginfer.testing.backend_contract`` checks a backend.

    Optional ``kv_cache_dtypes`` (API 5): the torch dtypes of the KV caches its attention reads; without it,
    float32, float16 and bfloat16. A quantized cache (``torch.int8``, ``torch.float8_e4m3fn``,
    ``torch.float8_e5m2``; ``core/kv_quant.py``'s rows of codes and a float32 scale) it lists must be written and
    read by its ``paged_attention``, which then also honours a ``kv_cache`` carrying fixed scales
    (``kv_quant.fixed_scales``). ``cache.kv_cache_dtype`` outside the list is a start-up error naming both.
    """

    name: str
    device: torch.device
    # The collective plugin ``parallel.collective: auto`` uses with several ranks ("gloo", "nccl", ...).
    default_collective: str
    # API 3. True: quantized weights run only through this backend's kernels, and a quant format whose matmul
    # op it lacks is a build-time error naming both (``layers.context.quant_kernel``) instead of the quant
    # method's torch dequantize path. False (the cpu backend): that torch path is this backend's fallback.
    quant_kernels_required: bool

    def kv_cache_budget_bytes(self, requested: int | None, fraction: float) -> int:
        """Bytes the paged cache may take: ``requested`` if given, else a fraction of what is free."""

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (key, value) pair of tensors per layer, ``[num_blocks, block_size, heads, dim]``; of a quantized
        ``dtype``, ``[..., dim + 4]`` (``kv_quant.row_width``: each row's codes, then its scale's bytes).

        With ``spec.value_in_key`` the value tensor is a view of the key tensor's first features
        (no storage of its own).
        """

    def prepare(self, batch: ForwardBatch) -> Any:
        """Build attention metadata once per step (masks, gather indices); stored in ``batch.attention``."""

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        logit_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's ``key``/``value`` into the cache at ``batch.slot_mapping``, then attend.

        ``query`` is ``[num_tokens, heads, head_dim]``, ``key``/``value`` are
        ``[num_tokens, kv_heads, head_dim]``; causal within each sequence, limited to the
        last ``sliding_window`` positions when given. Returns ``[num_tokens, heads, v_dim]``.
        ``value`` None: the cache's value is a view of its key (``KVCacheSpec.value_in_key``);
        only the key is written. ``logit_soft_cap``: scores become ``cap * tanh(scores / cap)``
        before the softmax (Gemma 2).
        """

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    copies: list[tuple[int, int]]) -> None:
        """Copy whole cache blocks ``src -> dst`` in every layer (n > 1 children forking a partial block)."""

    def synchronize(self) -> None:
        """Wait for queued device work (timings and host reads)."""

    def op(self, name: str) -> Any:
        """Optional: a faster kernel for a layer or quant op ("rms_norm", "rotary_neox", "marlin_matmul", ...), or None.

        Layers look it up once when built and fall back to their torch reference when the
        kernel returns None (or False) for inputs it does not handle. Ops and their signatures are
        those of ``pluginfer.core.kernels`` (a backend keeps a ``KernelTable``: the dense weight layouts,
        ``dense_layout`` / ``dense_pack`` / ``dense_linear``, are table ops too); the cpu backend also
        answers its native format ops (``ggml_dequantize``, ``grouped_dequantize``, ...).
        """

    def capture_decode(
        self, forward: Any, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
    ) -> Any:
        """Replays of decode steps (API 3), or None to run every step eagerly (most backends).

        Called once by each worker after its KV cache is allocated, unless ``enforce_eager`` is set or
        pipeline parallelism is on; ``forward(batch)`` is the model's forward followed by its LM head (a
        ``DecodeForward``: float32 logits of the sampled rows). The callable returned takes each step's batch
        and gives what ``forward`` gives, the logits, from a replay (the cuda backend's CUDA graphs of decode
        steps at bucketed batch sizes), or None: the worker then runs that step eagerly. The worker calls it
        outside ``torch.inference_mode`` (a replay of a tiny model's step is ~10 us faster without it): a
        replay that runs torch ops, or records, enters it itself. The block tables it is given may be narrower than ``max_blocks_per_seq``, and the batch has
        no ``attention`` metadata yet (``prepare`` runs only for the steps that run eagerly).
        """


@runtime_checkable
class Collective(Protocol):
    """One communication library over a group of ranks. Factory: ``factory(config: EngineConfig, rank: RankInfo)``.

    The factory joins the whole world (``rank.world_size`` processes; rendezvous at
    ``rank.master_addr:master_port`` where the library needs one) within
    ``config.parallel.timeout_s`` or raises. ``rank`` and ``world_size`` are this process's place in
    *this* group; ``src`` / ``dst`` below are ranks of this group. Every call is collective (all
    members make it, in the same order) except ``send`` / ``recv``. A peer that died or a wait past
    the timeout raises ``RuntimeError``; it never hangs forever.
    """

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place where the library allows; returns the result."""

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor (same shape on every rank) along ``dim``, in rank order."""

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s (same shape and dtype everywhere); returns it."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object (e.g. a ``StepInput``) from ``src``; every rank returns it."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order."""

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point to point: hand ``tensor`` to rank ``dst`` (which calls ``recv`` with the same shape)."""

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Point to point: fill ``tensor`` with what rank ``src`` sent; returns it."""

    def barrier(self) -> None:
        """Wait until every rank arrives."""

    def new_group(self, partition: list[list[int]]) -> Collective:
        """Split into disjoint groups (lists of this group's ranks covering all of them); every rank
        calls it with the same partition and gets the group it belongs to."""

    def close(self) -> None:
        """Leave the group and release the library's resources (idempotent)."""
