"""The responses a server keeps for ``GET /v1/responses/{id}`` and ``previous_response_id``: the last N, in memory.

Each entry holds the response body and its whole conversation as chat messages (earlier turns, this
input, this output), so a follow-up needs no walk back through entries that may have been dropped.
Least recently used first out; ``server.responses_store_size`` is N (0 keeps none). Lost on restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pluginfer.server.errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    # chat messages, instructions left out (they do not carry over)
    conversation: list[dict[str, Any]]


class ResponseStore:
    """An LRU of at most ``capacity`` responses by id."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry (now the most recently used); a 404 in OpenAI's shape when it is not (or no longer) kept."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, f"no response with id {response_id!r}: never stored (store: false), deleted, or "
                           f"dropped from the last {self.capacity} kept (server.responses_store_size)",
                           param, "response_not_found")
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]
