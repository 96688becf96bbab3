"""``use_beam_search: true`` on both endpoints: the search of ``engine/beam_search.py`` driven through the engine.

Each step runs the running beams of every prompt as one-token requests (``run_requests``: admission,
metrics, abort on disconnect, prefix-cached prompts). The ``n`` best beams are the choices, as in
vLLM. Fields beam search does not apply are a 400 naming them, not ignored.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any

from pluginfer.engine.beam_search import Beam, BeamSearch, BeamSearchParams
from pluginfer.engine.lora_request import LoRARequest
from pluginfer.engine.sequence import SamplingParams
from pluginfer.server.errors import bad_request
from pluginfer.server.state import ServerState
from pluginfer.server.streaming import run_requests

# What a beam-search request may set besides its prompt: the rest is sampling, which it does not do.
APPLIED = frozenset({"model", "messages", "prompt", "n", "max_tokens", "max_completion_tokens", "use_beam_search",
                     "length_penalty", "early_stopping", "ignore_eos", "user", "safety_identifier",
                     "prompt_cache_key", "metadata", "chat_template_kwargs", "add_generation_prompt",
                     "skip_special_tokens"})


def beam_params(body: Any, max_tokens: int) -> BeamSearchParams | None:
    """The request's beam search, or None; a 400 naming a field beam search would not apply."""
    if not body.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if name in body.model_fields_set:
                raise bad_request(f"{name}: applies only with use_beam_search: true", name)
        return None
    for name in sorted(body.model_fields_set - APPLIED):
        value = getattr(body, name)
        if value is None or value is False or (name == "temperature" and value == 0):
            continue  # asks for nothing beam search does not do
        raise bad_request(f"{name}: not applied by beam search (use_beam_search: true)", name)
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, length_penalty=body.length_penalty,
                                early_stopping=body.early_stopping, ignore_eos=body.ignore_eos)
    except ValueError as exc:
        raise bad_request(str(exc), "n") from None


async def search(state: ServerState, prompts: list[list[int]], params: BeamSearchParams, request_id: str,
                 prompt_field: str, lora_request: LoRARequest | None = None) -> list[list[Beam]]:
    """The beams of each prompt, best first; their text decoded with the tokenizer. ``lora_request``: the
    adapter the request's ``model`` named (None: the base)."""
    info = state.model_info
    try:
        searches = [BeamSearch(list(prompt), params, info.eos_token_ids) for prompt in prompts]
    except ValueError as exc:
        raise bad_request(str(exc), "n") from None
    for prompt in prompts:
        if len(prompt) + params.max_tokens > info.max_model_len:
            raise bad_request(f"a prompt of {len(prompt)} tokens plus max_tokens {params.max_tokens} is over the "
                              f"context of {info.max_model_len}", prompt_field)
    step = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=searches[0].candidates)
    number = 0
    while live := [s for s in searches if not s.done]:
        wanted = list(dict.fromkeys(tuple(seq) for s in live for seq in s.running()))
        table: dict[tuple[int, ...], dict[int, float]] = {}
        async with aclosing(run_requests(state, [list(seq) for seq in wanted], step,
                                         f"{request_id}-beam{number}", prompt_field, lora_request)) as outputs:
            async for index, output in outputs:
                if output.finished:
                    table[wanted[index]] = output.outputs[0].logprobs[0]
        number += 1
        for s in live:
            s.advance([table[tuple(seq)] for seq in s.running()])
        await asyncio.sleep(0)
    results = [s.results() for s in searches]
    for beams in results:
        for beam in beams:
            beam.text = state.tokenizer.decode(beam.token_ids, skip_special_tokens=True)
    return results


def finish_reason(beam: Beam, eos_token_ids: set[int]) -> str:
    return "stop" if beam.token_ids and beam.token_ids[-1] in eos_token_ids else "length"
