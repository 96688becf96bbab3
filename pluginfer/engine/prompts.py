"""A prompt's forms (text, token ids, vLLM's prompt dict with media) and the logprobs of its tokens."""

from __future__ import annotations

import torch

from pluginfer.engine.sequence import Sequence


def split_prompt(prompt: str | list[int] | dict) -> tuple[str | list[int], dict | None]:
    """(text or token ids, multi_modal_data or None) of a prompt; a dict is vLLM's prompt dict."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown:
        raise ValueError(f"prompt: unsupported key(s) {', '.join(map(repr, unknown))} (supported: prompt, "
                         "prompt_token_ids, multi_modal_data)")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt: give exactly one of 'prompt' and 'prompt_token_ids'")
    data = prompt.get("multi_modal_data")
    if data is not None and not isinstance(data, dict):
        raise ValueError("prompt: multi_modal_data must be a dict such as {'image': image}")
    return prompt.get("prompt", prompt.get("prompt_token_ids")), data or None


def record_prompt_logprobs(seq: Sequence, first: int, logits: torch.Tensor) -> None:
    """Logprob of each prompt token ``first + 1 ...`` given what precedes it, with the top alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(seq.prompt_token_ids[first + 1:first + 1 + logits.shape[0]])
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    k = seq.params.prompt_logprobs or 0
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # the first prompt token has no context
    for row, (token, value) in enumerate(zip(targets.tolist(), chosen)):
        entry = {token: value}
        if k:
            entry.update(zip(top_ids[row].tolist(), top_values[row].tolist()))
            entry[token] = value
        seq.prompt_logprobs.append(entry)
