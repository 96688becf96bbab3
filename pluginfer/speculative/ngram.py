"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's last
``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``), in its prompt or output.

No model and no state: it pays off where the output repeats its context (editing code, quoting a document).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pluginfer.core.config import EngineConfig, SpeculativeConfig
from pluginfer.core.speculative import DraftRequest


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [self._lookup(np.asarray(request.token_ids, dtype=np.int64), request.max_tokens)
                for request in requests]

    def forget(self, seq_ids: list[int]) -> None:
        pass

    def _lookup(self, tokens: np.ndarray, count: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            # windows start before length - n, so every match has a token after it; the suffix itself is not one
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start:start + count].tolist()
        return []


def build(config: SpeculativeConfig, engine: EngineConfig) -> NgramProposer:
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
