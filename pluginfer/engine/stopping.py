"""Whether a sequence is finished after its newest token, and why."""

from __future__ import annotations

from pluginfer.engine.detokenizer import IncrementalDetokenizer
from pluginfer.engine.sequence import FinishReason, Sequence


def check_stop(
    seq: Sequence,
    token_id: int,
    detokenizer: IncrementalDetokenizer | None,
    eos_token_ids: set[int],
    max_model_len: int,
) -> FinishReason | None:
    """Finish reason for ``seq`` once ``token_id`` is appended to its output (and detokenized), else None.

    The EOS or stop token stays in ``output_token_ids`` (as in vLLM); its text is not emitted
    when it is a special token and ``skip_special_tokens`` is set.
    """
    params = seq.params
    num_output = len(seq.output_token_ids)
    # Before min_tokens only the length limits stop a sequence (the sampler masks EOS and stop ids).
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if detokenizer is not None and detokenizer.stopped_by is not None:
            return FinishReason.STOP
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return FinishReason.LENGTH
    if len(seq) >= max_model_len:
        return FinishReason.LENGTH
    return None
