"""Logprobs in the two OpenAI shapes: chat (``content`` entries) and legacy completions (parallel lists).

The engine gives, per generated token, ``{token_id: logprob}`` holding the sampled token and the
top alternatives asked for. Token strings are each token decoded alone, as vLLM does.
"""

from __future__ import annotations

from typing import Any

# JSON has no -Infinity; a probability that underflowed reads as this
_FLOOR = -9999.0


def _clamp(value: float) -> float:
    return value if value > _FLOOR else _FLOOR


def _top(entry: dict[int, float], count: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:count]


class TokenText:
    """Each token id decoded on its own, cached (the same ids recur across chunks and choices)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def chat_logprobs(text_of: TokenText, token_ids: list[int], logprobs: list[dict[int, float]],
                  top_count: int) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        token = text_of(token_id)
        content.append({
            "token": token, "logprob": _clamp(entry[token_id]), "bytes": list(token.encode()),
            "top_logprobs": [{"token": text_of(t), "logprob": _clamp(v), "bytes": list(text_of(t).encode())}
                             for t, v in _top(entry, top_count)],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(text_of: TokenText, token_ids: list[int], logprobs: list[dict[int, float] | None],
                        top_count: int, offset: int) -> dict[str, Any]:
    """``offset``: where the first token's text starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        token = text_of(token_id)
        tokens.append(token)
        if entry is None:
            # the first prompt token (echo): nothing before it to predict it
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(_clamp(entry[token_id]))
            top_logprobs.append({text_of(t): _clamp(v) for t, v in _top(entry, top_count)})
        text_offset.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}
