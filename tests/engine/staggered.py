"""Requests that join an engine at different steps, run to the end: the outputs two engine setups must agree on."""

from __future__ import annotations

from pluginfer.engine.engine import LLMEngine
from pluginfer.engine.sequence import SamplingParams


def run_staggered(engine: LLMEngine, requests: dict[str, tuple[int, list[int], SamplingParams]]) -> tuple[dict, int]:
    """Add each ``(joins at step, prompt, params)`` request at its step and step until all finish (at least 20
    steps); the finished outputs by request id, as ``(index, text, token_ids, logprobs, finish_reason)`` per
    choice, and the number of steps taken. Shuts the engine down."""
    finished, step = {}, 0
    try:
        while step < 20 or engine.has_unfinished_requests():
            for request_id, (joins, prompt, params) in requests.items():
                if joins == step:
                    engine.add_request(prompt, params, request_id)
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason)
                                                   for c in output.outputs]
            step += 1
        return finished, step
    finally:
        engine.shutdown()
