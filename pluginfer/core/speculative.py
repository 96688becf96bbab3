"""What a speculative-decoding proposer is handed and returns (the ``proposer`` plugin kind).

Each step, before the forward, the engine asks the proposer for draft tokens of every sequence that
decodes; the model then computes the last token and the drafts in one pass, and the engine keeps the
drafts the model itself would have produced (docs/speculative.md). A proposer only proposes: what it
returns never changes the output, only how many model passes it takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class DraftRequest:
    """One decoding sequence: its id (stable while it runs), every token so far (prompt, then output),
    and the most draft tokens it may take this step (at least 1)."""

    seq_id: int
    token_ids: list[int]
    max_tokens: int


class Proposer(Protocol):
    """Built by a ``ProposerSpec``'s factory: ``build(config: SpeculativeConfig, engine: EngineConfig)``."""

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Draft tokens for each request, in order: at most its ``max_tokens``, possibly none."""

    def forget(self, seq_ids: list[int]) -> None:
        """These sequences finished or were preempted: drop any state kept for them."""
