"""The four protocols a plugin implements: ModelPipeline, QuantMethod, DeviceBackend, Collective.

A plugin registers a *spec* (see ``hookspecs.PluginSpec``) whose ``factory`` points at a
callable building one of these. The core only ever talks to plugins through them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from pluginfer.core.batch import ForwardBatch


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
        return self.num_layers * self.num_kv_heads * width * dtype.itemsize


@dataclass
class BuildContext:
    """What a model factory receives besides the HF config: the plugins it builds on."""

    backend: DeviceBackend
    quant: QuantMethod
    collective: Collective
    dtype: torch.dtype
    max_model_len: int
    # Experts per MoE layer kept in host memory and copied to the device when routed (cache config).
    num_experts_offload_per_rank: int = 0
    # Sequences one step may batch (scheduler config): a weight layout may be chosen for it.
    max_num_seqs: int = 1


@runtime_checkable
class ModelPipeline(Protocol):
    """One model family. Factory signature: ``factory(hf_config: dict, ctx: BuildContext)``.

    The pipeline is a ``torch.nn.Module`` built from ``pluginfer.layers``; its linear layers
    take their parameters and matmul from ``ctx.quant`` and their attention from
    ``ctx.backend``. The factory raises ``ValueError`` naming the config field for any
    combination it does not implement (never ignore a field silently).
    """

    def kv_cache_spec(self) -> KVCacheSpec:
        """Shape of the paged cache this model needs."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (checkpoint name, tensor) pairs as they stream from disk.

        Map names to parameters and call each parameter's ``weight_loader`` (which shards
        for tensor parallelism and hands the tensor to the quant method). Raise ``KeyError``
        naming the tensor for an unexpected one and for any parameter left unloaded.
        """

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the flat batch; return hidden states of the rows in ``batch.logits_indices``."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to float32 logits over the whole vocabulary."""


@runtime_checkable
class QuantMethod(Protocol):
    """One weight format for linear layers. Factory: ``factory(quant_config: dict | None)``.

    A linear layer calls ``create_weights`` once, lets the loader fill the registered
    parameters through their ``weight_loader``, calls ``process_weights_after_loading``
    (repacking), then ``apply`` at every forward.
    """

    name: str

    def create_weights(
        self, layer: torch.nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        """Register the parameters this format keeps for an ``output_size x input_size`` weight.

        Sizes are this rank's shard. Each parameter gets ``output_dim`` / ``input_dim``
        attributes (which axis is sharded) so layers can load slices into it.
        """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack or convert after every shard arrived (no-op for plain weights)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for this format."""


@runtime_checkable
class DeviceBackend(Protocol):
    """One device. Factory: ``factory(config: EngineConfig)``.

    The spec's ``check`` tells whether the device is usable on this machine.
    """

    name: str
    device: torch.device

    def kv_cache_budget_bytes(self, requested: int | None, fraction: float) -> int:
        """Bytes the paged cache may take: ``requested`` if given, else a fraction of what is free."""

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (key, value) pair of tensors per layer, ``[num_blocks, block_size, heads, dim]``.

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
    ) -> torch.Tensor:
        """Write this step's ``key``/``value`` into the cache at ``batch.slot_mapping``, then attend.

        ``query`` is ``[num_tokens, heads, head_dim]``, ``key``/``value`` are
        ``[num_tokens, kv_heads, head_dim]``; causal within each sequence, limited to the
        last ``sliding_window`` positions when given. Returns ``[num_tokens, heads, v_dim]``.
        ``value`` None: the cache's value is a view of its key (``KVCacheSpec.value_in_key``);
        only the key is written.
        """

    def synchronize(self) -> None:
        """Wait for queued device work (timings and host reads)."""

    def op(self, name: str) -> Any:
        """Optional: a faster kernel for a layer op ("rms_norm", "silu_and_mul", "rotary_neox"), or None.

        Layers look it up once when built and fall back to their torch reference when the
        kernel returns None (or False) for inputs it does not handle. Signatures are those of
        ``pluginfer.backends.native``.
        """


@runtime_checkable
class Collective(Protocol):
    """One communication library. Factory: ``factory(config: EngineConfig)``."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place where the library allows; returns the result."""

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor along ``dim``."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object (e.g. a ForwardBatch) from ``src`` to every rank."""

    def barrier(self) -> None:
        """Wait until every rank arrives."""
