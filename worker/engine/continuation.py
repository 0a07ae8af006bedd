"""Continuations: a request resubmitted with the output it already has (gateway failover).

``check_continuation`` validates the tokens against the request (ValueError with a message a
person can act on; :class:`FinishedContinuation` for the whole output of a finished request);
the earlier speculation counters are carried over by ``SpecDecoder.add``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from draftwise.worker.core.request import FinishedContinuation

__all__ = ["FinishedContinuation", "check_continuation"]

if TYPE_CHECKING:
    from draftwise.worker.sampling.sampling_params import SamplingParams


def check_continuation(
    continuation: Sequence[int],
    vocab_size: int,
    num_prompt_tokens: int,
    max_model_len: int,
    max_tokens: int,
    eos_token_ids: Sequence[int],
    params: SamplingParams,
) -> list[int]:
    """``continuation`` as a list, or ValueError when it is not a possible unfinished output of
    the request: ids out of range, too long for the context or max_tokens, or containing a token
    that would have ended the request (EOS, a stop token id)."""
    ids = list(continuation)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"continuation token ids must be integers in [0, {vocab_size}), got {t!r}")
    if not ids:
        return ids
    room = max_model_len - num_prompt_tokens
    if len(ids) > room or len(ids) > max_tokens:
        raise ValueError(
            f"continuation ({len(ids)} tokens) is longer than any output of this request: the prompt is "
            f"{num_prompt_tokens} tokens, max_model_len={max_model_len}, max_tokens={max_tokens}"
        )
    if len(ids) == room:
        raise FinishedContinuation(
            f"continuation is already finished: prompt ({num_prompt_tokens} tokens) + continuation "
            f"({len(ids)} tokens) reach max_model_len={max_model_len}; nothing is left to generate",
            "length",
        )
    if len(ids) == max_tokens:
        raise FinishedContinuation(
            f"continuation is already finished: its {len(ids)} tokens reach max_tokens={max_tokens}; "
            "nothing is left to generate",
            "length",
        )
    stops = set(eos_token_ids) | set(params.stop_token_ids)
    for i, t in enumerate(ids):
        if t in stops:
            what = "a stop token id" if t in params.stop_token_ids else "EOS"
            message = f"continuation is already finished: token {i} ({t}) is {what}, which ends the request"
            if i < len(ids) - 1:
                raise ValueError(f"{message} (the output cannot go on after it)")
            raise FinishedContinuation(message, "stop", stop_token_id=t if t in params.stop_token_ids else None)
    return ids
