"""The ``draft_model`` proposer: a small model with the target's tokenizer decodes each sequence's drafts.

It runs an engine of its own in the same process (one rank, its own KV cache, prefix caching on), so that
each step it computes only what it has not seen of a sequence (the tokens accepted since its last drafts,
from the start of their KV block) and then decodes the drafts of every sequence in one batch, greedily.
"""

from __future__ import annotations

import itertools
import logging

from pluginfer.core.config import EngineConfig, SpeculativeConfig
from pluginfer.core.speculative import DraftRequest

logger = logging.getLogger(__name__)

# of the memory left once the target's cache is taken: the draft model is small
DRAFT_KV_CACHE_FRACTION = 0.1


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, target: EngineConfig) -> None:
        from pluginfer.engine.engine import LLMEngine
        from pluginfer.text.tokenizer import load_tokenizer

        settings = target.model_dump(exclude={"parallel", "server", "speculative_config", "testing"})
        settings.update(model=config.model, tokenizer=None, revision=None, quant="auto", max_model_len=None)
        settings["cache"].update(num_blocks=None, kv_cache_memory=None, kv_cache_fraction=DRAFT_KV_CACHE_FRACTION,
                                 enable_prefix_caching=True)
        self.engine = LLMEngine(EngineConfig.model_validate(settings))
        theirs = load_tokenizer(target.tokenizer or target.model).get_vocab()
        if self.engine.tokenizer.get_vocab() != theirs:
            self.engine.shutdown()
            raise ValueError(f"speculative_config.model {config.model}: its tokenizer's vocabulary is not the "
                             f"target model's ({target.model}); a draft model must share the tokenizer")
        self._ids = itertools.count()

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        from pluginfer.engine.sequence import SamplingParams

        names = []
        for request in requests:
            name = f"draft-{next(self._ids)}"
            params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
            self.engine.add_request(request.token_ids, params, name)
            names.append(name)
        drafts = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step(only_finished=True):
                # a sequence past the draft model's context gets no drafts
                drafts[output.request_id] = [] if output.error else output.outputs[0].token_ids
        return [drafts.get(name, []) for name in names]

    def forget(self, seq_ids: list[int]) -> None:
        # nothing is kept per sequence; the prefix cache lets go of its blocks when others need them
        pass


def build(config: SpeculativeConfig, target: EngineConfig) -> DraftModelProposer:
    return DraftModelProposer(config, target)
