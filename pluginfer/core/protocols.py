"""The protocols of the engine's model-side plugins: ModelPipeline (with its MultiModalProcessor) and QuantMethod,
and the values the engine hands them (BuildContext, ShardSpec, KVCacheSpec, RankInfo, IntermediateTensors).

A plugin registers a *spec* (``core/specs.py``) whose ``factory`` points at a callable building one of these.
The device and communication plugins' protocols are ``core/device_backend.py`` and ``core/collective.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from pluginfer.core.kv_layout import SCALE_BYTES, is_quantized

if TYPE_CHECKING:
    from pluginfer.core.batch import ForwardBatch
    from pluginfer.core.collective import Collective
    from pluginfer.core.device_backend import DeviceBackend


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token costs in the paged cache: per layer, K of ``head_dim`` and V of ``v_head_dim``.

    ``value_in_key``: no value is stored; the value is the last ``value_in_key`` features of the
    cached key (``core.kv_layout.value_in_key``: a quantized row's scale, at its end, serves both).
    Multi-head latent attention (DeepSeek) caches one "head" per token, the rope key followed by the
    compressed latent, and reads the latent back as the value.
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
    ``weight_routes()`` (llama's): with LoRA on, the ``(fused parameter part, checkpoint part, shard id)`` routes
    of the fused projections (``layers.weights.LLAMA_STACKED``: ``(".qkv_proj.", ".q_proj.", "q")``, ...), which
    place an adapter's per-projection tensors in the fused layers.
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

    Optional method ``checkpoint_tensors(tensors)``: the checkpoint's ``(name, tensor)`` pairs, a lazy iterable,
    as the model is to receive them (an iterator of pairs); a format whose tensors are combined before any layer
    sees them (block-wise FP8: each weight's levels with their scales, for every layer, experts included) combines
    them here. Without it the pairs reach the model as read.
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
