"""Per-request limits (``server.*`` in the config): what one request may ask of the engine.

Each is a 400 naming the field, checked before anything is tokenized or queued. The body size
(``max_request_bytes``, a 413) is checked in ``state.read_body``; ``logprobs`` in the request models.
"""

from __future__ import annotations

from pluginfer.core.config import ServerConfig
from pluginfer.server.errors import bad_request
from pluginfer.server.protocol import SamplingRequest


def check_limits(body: SamplingRequest, limits: ServerConfig, max_model_len: int, num_prompts: int = 1) -> None:
    """Refuse a request over the server's limits, naming the field; ``num_prompts``: completions' prompt list."""
    if body.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n} (server.max_n), got {body.n}", "n")
    if num_prompts > limits.max_prompts:
        raise bad_request(f"at most {limits.max_prompts} prompts in one request (server.max_prompts), "
                          f"got {num_prompts}", "prompt")
    max_tokens, field = body._max_tokens()
    if max_tokens is not None and max_tokens > max_model_len:
        raise bad_request(f"{field} must be at most the model's context of {max_model_len} tokens, "
                          f"got {max_tokens}", field)
    for name, values in (("stop", body.stop), ("stop_token_ids", body.stop_token_ids)):
        if values is not None and len(values) > limits.max_stop:
            raise bad_request(f"{name}: at most {limits.max_stop} entries (server.max_stop), got {len(values)}",
                              name)
    longest = max(map(len, body.stop or [""]))
    if longest > limits.max_stop_chars:
        raise bad_request(f"stop: each stop string has at most {limits.max_stop_chars} characters "
                          f"(server.max_stop_chars), got one of {longest}", "stop")
