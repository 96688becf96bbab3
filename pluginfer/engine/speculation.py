"""The proposer ``speculative_config`` names, built for the scheduler (the engine checks its drafts)."""

from __future__ import annotations

from typing import Any

from pluginfer.core.config import EngineConfig


def build_proposer(config: EngineConfig) -> tuple[Any, int]:
    """(the proposer, draft tokens per step) of ``speculative_config``; (None, 0) when it is unset."""
    spec = config.speculative_config
    if spec is None:
        return None, 0
    from pluginfer.core.registry import get_registry

    build = get_registry().load("proposer", spec.method)
    return build(spec, config), spec.num_speculative_tokens
