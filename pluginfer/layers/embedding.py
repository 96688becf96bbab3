"""Vocabulary-parallel embedding and the LM head (each rank holds a slice of the vocabulary).

Rank ``r`` holds rows ``[r * shard_size, (r + 1) * shard_size)``, padding rows zero; the embedding all-reduces,
the head all-gathers and cuts the padding off so it is never sampled. A quantized checkpoint tensor (GGUF
blocks) goes to the quant method's ``vocab_table``, which keeps this rank's rows in their format: the embedding
dequantizes only the rows it looks up, the head runs the format's matmul (a tied head shares the table).
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
        self.hidden_size = hidden_size
        self.table_method, self.backend = ctx.quant, ctx.backend  # for a quantized table (vocab_table)
        # a VocabTable (protocols.py) in place of ``weight`` when the checkpoint's is quantized
        self.table = None
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if tuple(loaded.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} does not match "
                             f"({self.vocab_size}, {self.hidden_size})")
        if not isinstance(loaded, torch.Tensor):
            self._load_table(param, loaded)
            return
        self._copy_slice(param, loaded)

    def _load_table(self, param: nn.Parameter, loaded: object) -> None:
        """Keep this rank's rows of a quantized checkpoint tensor through the quant method; drop the dense weight."""
        held = max(0, min(self.shard_size, self.vocab_size - self.start))
        self.table = self.table_method.vocab_table(loaded, self.start, held, param.dtype, self.backend)
        if self.table is None:
            raise ValueError(f"embedding: a {type(loaded).__name__} checkpoint tensor, which the quant method "
                             f"{self.table_method.name!r} cannot hold")
        empty = nn.Parameter(torch.empty(0, self.hidden_size, dtype=param.dtype), requires_grad=False)
        empty.weight_loader = self.weight_loader
        self.weight = empty

    def _copy_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of a full-vocabulary tensor; the padding rows past the vocabulary stay zero."""
        part = loaded[self.start:self.start + self.shard_size]
        if part.shape[0] < self.shard_size:
            param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.embed(ids) if self.table is not None else F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        held = self.table.rows if self.table is not None else self.shard_size
        outside = (local < 0) | (local >= held)
        out = self._lookup(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0)
        return self.collective.all_reduce(out)


class LMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; ties to the embedding's weight when asked.

    An untied head moves to the layout its fastest matmul reads once it has loaded
    (``layers/dense.py``): the largest single matmul of a decode step. A tied head shares the
    embedding's ``[vocab, hidden]`` table and keeps it, quantized or not.
    """

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size)
        self.dense = dense.DenseMatmul.for_context(current_context())
        self.layout = "checkpoint"
        self.tied_to: VocabParallelEmbedding | None = None
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
        object.__setattr__(self, "tied_to", embedding)  # a reference, not a submodule (its weight is not ours)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        super().weight_loader(param, loaded, shard_id)
        if param is self.weight and self.table is None:
            self.layout, weight = self.dense.relayout(param.data)
            if weight is not param.data:
                self.weight = nn.Parameter(weight, requires_grad=False)

    def process_weights_after_loading(self) -> None:
        if self.tied_to is not None and self.tied_to.table is not None:
            self.table, self.weight = self.tied_to.table, self.tied_to.weight  # the dense placeholder goes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            bias = None if self.bias is None else self.bias[: self.table.rows]
            logits = self.table.logits(hidden, bias)
            if self.table.rows < self.shard_size:  # padding rows: zero logits, cut off below
                logits = F.pad(logits, (0, self.shard_size - self.table.rows))
        else:
            logits = self.dense.linear(self.layout, hidden, self.weight, self.bias, self.shard_size)
        if self.tp_size > 1:
            logits = self.collective.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
