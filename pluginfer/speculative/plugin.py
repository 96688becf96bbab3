"""Registers the built-in speculative proposers (cheap: a proposer's module loads only when selected)."""

from pluginfer.core.hookspecs import ProposerSpec, hookimpl


@hookimpl
def pluginfer_proposers() -> list[ProposerSpec]:
    return [ProposerSpec(name="ngram", aliases=("prompt_lookup",), factory="pluginfer.speculative.ngram:build",
                         description="prompt lookup: drafts what followed the last tokens where they appeared before"),
            # a model needs the engine: the engine ships this proposer, and this plugin names it
            ProposerSpec(name="draft_model", aliases=("draft",), factory="pluginfer.engine.draft_model:build",
                         description="a small model with the same tokenizer decodes the drafts (speculative_config.model)")]
