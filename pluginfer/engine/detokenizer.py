"""Incremental detokenization: turn one token at a time into text that is safe to stream.

Two windows of ids are decoded per token, as in vLLM and TGI: ``[prefix_offset:]`` and
``[prefix_offset:read_offset]``; the difference is the new text. Decoding a few tokens of
context before the new ones keeps leading spaces and merged characters right, and text is
held back while it ends in an incomplete UTF-8 character ('\ufffd') or in what may become
a stop string.
"""

from __future__ import annotations

from typing import Any

from pluginfer.engine.sequence import SamplingParams

# prompt tokens decoded as context before the first output token
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Streams the output text of one sequence, cutting it at the first stop string."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop: list[str] = list(params.stop)
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_output_tokens = 0
        self._held = ""  # decoded text held back because it may start a stop string
        self._hold_len = max((len(s) for s in self.stop), default=1) - 1
        self._text = ""
        # pushed tokens not decoded yet (no stop strings: none waits on text)
        self._pending: list[int] = []
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        """The output text so far (pushed tokens decoded first, one at a time, as ``append`` does)."""
        if self._pending:
            self._catch_up()
        return self._text

    def push(self, token_id: int) -> None:
        """Feed one generated token, decoding it only when its text is needed: at once when stop strings
        must be checked, else when ``text`` is read or the output finishes. The text is the same as with
        ``append`` (the same decodes in the same order); a request whose text is read only at its end (the
        offline ``LLM.generate``) decodes its tokens in one go instead of between two forwards."""
        if self.stop:
            self.append(token_id)
        else:
            self._pending.append(token_id)

    def _catch_up(self) -> None:
        pending, self._pending = self._pending, []
        for token_id in pending:
            self.append(token_id)

    def append(self, token_id: int) -> str:
        """Feed one generated token; return the text it makes safe to emit (may be '')."""
        if self._pending:
            self._catch_up()
        if self.stopped_by is not None:
            return ""
        self._ids.append(token_id)
        self._num_output_tokens += 1
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # nothing new yet, or a character still waits for its next bytes
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._emit(new_text[len(prefix_text) :], final=False)

    def finish(self) -> str:
        """Flush what was held back (the end of the output, unless a stop string matched)."""
        if self._pending:
            self._catch_up()
        if self.stopped_by is not None:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._emit(new_text[len(prefix_text) :], final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _emit(self, delta: str, final: bool) -> str:
        pending = self._held + delta
        self._held = ""
        # Like vLLM, stop strings count only once more than min_tokens tokens were generated.
        if self.stop and self._num_output_tokens > self.params.min_tokens:
            match = _first_stop(pending, self.stop)
            if match is not None:
                position, stop = match
                end = position + len(stop) if self.params.include_stop_str_in_output else position
                self.stopped_by = stop
                return self._commit(pending[:end])
        if self.stop and not final:
            hold = _stop_prefix_len(pending, self.stop, self._hold_len)
            if hold:
                pending, self._held = pending[:-hold], pending[-hold:]
        return self._commit(pending)

    def _commit(self, text: str) -> str:
        self._text += text
        return text


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any stop string in ``text``, as (position, stop string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        position = text.find(stop)
        if position != -1 and (best is None or position < best[0]):
            best = (position, stop)
    return best


def _stop_prefix_len(text: str, stops: list[str], longest: int) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    for length in range(min(longest, len(text)), 0, -1):
        suffix = text[-length:]
        if any(stop.startswith(suffix) and len(stop) > length for stop in stops):
            return length
    return 0
