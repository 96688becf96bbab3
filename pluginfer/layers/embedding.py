"""Vocabulary-parallel embedding and the LM head (each rank holds a slice of the vocabulary).

Rank ``r`` of ``tp_size`` holds rows ``[r * shard_size, (r + 1) * shard_size)`` with ``shard_size =
ceil(vocab_size / tp_size)``; rows past ``vocab_size`` (the last ranks' padding) are zeros. The embedding
looks up the ids in its slice and all-reduces; the head all-gathers its logits slices and cuts the padding
off (``[..., :vocab_size]``), so a padding row can never be sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pluginfer.layers import dense
from pluginfer.layers.context import current_context


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        ctx = current_context()
        self.collective = ctx.collective
        self.tp_rank, self.tp_size = ctx.collective.rank, ctx.collective.world_size
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.dim() != 2 or loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} does not match "
                             f"({self.vocab_size}, {param.shape[1]})")
        self._copy_slice(param, loaded)

    def _copy_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of a full-vocabulary tensor; the padding rows past the vocabulary stay zero."""
        part = loaded[self.start:self.start + self.shard_size]
        if part.shape[0] < self.shard_size:
            param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.collective.all_reduce(out)


class LMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; ties to the embedding's weight when asked.

    An untied head moves to the layout its fastest matmul reads once it has loaded
    (``layers/dense.py``): the largest single matmul of a decode step. A tied head shares the
    embedding's ``[vocab, hidden]`` table and keeps it.
    """

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size)
        self.dense = dense.DenseMatmul.for_context(current_context())
        self.layout = "checkpoint"
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.shard_size, dtype=self.weight.dtype), requires_grad=False)
            self.bias.weight_loader = self.bias_loader

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if tuple(loaded.shape) != (self.vocab_size,):
            raise ValueError(f"lm_head bias: checkpoint shape {tuple(loaded.shape)} does not match "
                             f"({self.vocab_size},)")
        self._copy_slice(param, loaded)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        super().weight_loader(param, loaded, shard_id)
        if param is self.weight:
            self.layout, weight = self.dense.relayout(param.data)
            if weight is not param.data:
                self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.dense.linear(self.layout, hidden, self.weight, self.bias, self.shard_size)
        if self.tp_size > 1:
            logits = self.collective.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
