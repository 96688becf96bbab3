"""ForwardBatch: everything one step's forward pass needs, as flat tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the server's process reads TOKEN_TYPE_SHIFT without torch
    import torch

# A pooling request's token types (a sentence pair's second text, for an encoder that has them) ride in the
# high bits of ``input_ids``: ``token_type << TOKEN_TYPE_SHIFT | token_id``; type 0 (every generating request)
# changes nothing.
TOKEN_TYPE_SHIFT = 30


@dataclass
class ForwardBatch:
    """One engine step, flattened: the tokens of every scheduled sequence back to back.

    Sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]`` of ``input_ids``.
    Its keys are the ``seq_lens[i]`` first cache slots named by ``block_tables[i]``,
    the last ``query_lens[i]`` of which are written by this very step.

    ``multimodal``: row -> the multimodal inputs of that row's request, as the model's multimodal processor made
    them (``MultiModalPrompt.inputs``); the row's positions say which of its tokens this step computes. Only
    rows whose request carries such inputs are keys.
    """

    input_ids: torch.Tensor  # [num_tokens] int64 (token types above TOKEN_TYPE_SHIFT, where a request has them)
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) of each token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64: prefix sums of query_lens
    seq_lens: torch.Tensor  # [num_seqs] int64: keys per sequence after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    logits_indices: torch.Tensor  # [num_samples] int64: rows whose logits are sampled
    query_lens: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    attention: Any = None  # backend-specific metadata, built once per step by DeviceBackend.prepare
    extras: dict[str, Any] = field(default_factory=dict)
    multimodal: dict[int, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
