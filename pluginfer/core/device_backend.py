"""What the engine asks of a device backend plugin (kind ``backend``): the ``DeviceBackend`` protocol, and the
``DecodeForward`` a worker hands its ``capture_decode``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from pluginfer.core.batch import ForwardBatch
    from pluginfer.core.protocols import KVCacheSpec


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


@runtime_checkable
class DeviceBackend(Protocol):
    """One device. Factory: ``factory(config: EngineConfig, rank: RankInfo)``.

    The spec's ``check`` tells whether the device is usable on this machine. ``rank.local_rank``
    picks this rank's device; ``rank.local_world_size`` ranks share the machine (and its cores).
    ``layers.backend_base.BaseDeviceBackend`` implements every member over a ``KernelTable``: subclass it and
    override what the device does differently. ``pluginfer.testing.backend_contract`` checks a backend.

    Optional ``kv_cache_dtypes`` (API 5): the torch dtypes of the KV caches its attention reads; without it,
    float32, float16 and bfloat16. A quantized cache (``torch.int8``, ``torch.float8_e4m3fn``,
    ``torch.float8_e5m2``; ``layers/kv_quant.py``'s rows of codes and a float32 scale) it lists must be written and
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

        With ``spec.value_in_key`` the value tensor is a view of the key tensor's last features
        (``core.kv_layout.value_in_key``; no storage of its own).
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
        those of the kernel table, ``pluginfer.core.kernels`` (a backend keeps a ``KernelTable``: the dense weight
        layouts, ``dense_layout`` / ``dense_pack`` / ``dense_linear``, are table ops too); the cpu backend also
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
