"""The OutputProcessor: from sampled tokens to what callers see.

It owns each request's text state (its incremental detokenizer and stop-string matching)
and decides when a request is finished: end-of-sequence or a stop token id, a stop string,
max_tokens or the end of the context. It turns tokens into :class:`RequestDelta` and final
:class:`RequestOutput` objects, and only reads the request's token lists and sampling
parameters besides: nothing in it touches the model, the KV cache or the scheduler, so it can
later move off the engine thread (the engine then hands it tokens and takes deltas back).

It returns data and calls nothing back: :meth:`OutputProcessor.append` says what it kept and
whether (and why) the request is finished (:class:`Finish`); the engine finishes the request
and frees its blocks, then asks for the delta (:meth:`OutputProcessor.delta`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from draftwise.worker.core.outputs import RequestDelta, RequestOutput, SpecStats
from draftwise.worker.core.request import FinishedContinuation, FinishReason, Request
from draftwise.worker.sampling.sampler import TokenLogprobs
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.text.detokenizer import IncrementalDetokenizer
from draftwise.worker.text.tokenizer import Tokenizer

__all__ = ["Appended", "Finish", "OutputProcessor"]


@dataclass(frozen=True)
class Finish:
    """Why a request is finished."""

    reason: FinishReason
    stop_reason: str | int | None = None  # the stop string or stop token id


@dataclass(frozen=True)
class Appended:
    """What :meth:`OutputProcessor.append` kept of a step's tokens for one request."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # per kept token, when the request asks for logprobs
    first_token_index: int  # output index of the first kept token
    text: str  # text released by them
    finish: Finish | None  # set when a finish condition was met (the tokens after it were dropped)


class OutputProcessor:
    """Detokenization, stop checks and finishing for every request of one engine."""

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # request id -> its text state

    def add(self, req_id: str, prompt_ids: list[int], params: SamplingParams, continuation: Sequence[int]) -> None:
        """Text state for a new request. ``continuation``: output it already has (read without
        releasing text); ValueError when its text already contains a stop string."""
        if self.tokenizer is None:
            if params.stop:
                raise ValueError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)")
            return
        detok = IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            stop=params.stop or (),
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        if continuation and detok.prime(continuation[:-1]) is not None:
            raise ValueError(
                f"continuation is already finished: its text contains the stop string {detok.stop_matched!r} "
                "before its last token (the output cannot go on after it)"
            )
        if continuation and detok.prime(continuation[-1:]) is not None:
            raise FinishedContinuation(
                f"continuation is already finished: its text contains the stop string {detok.stop_matched!r}",
                "stop",
                stop_str=detok.stop_matched,
            )
        self.detokenizers[req_id] = detok

    def text(self, req: Request) -> str:
        """The output text released so far."""
        detok = self.detokenizers.get(req.request_id)
        return detok.output_text if detok is not None else ""

    def forget(self, req: Request) -> None:
        self.detokenizers.pop(req.request_id, None)

    def append(self, req: Request, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs | None]) -> Appended:
        """Add sampled tokens to ``req`` one at a time, stopping at the first finish condition
        (the tokens after it are dropped). Returns what was kept and, when a finish condition
        was met, why; finishing the request is the engine's. On an error, ``req``'s output is
        as it was before the call."""
        sent = len(req.output_token_ids)
        try:
            return self._append(req, tokens, logprobs)
        except BaseException:
            del req.output_token_ids[sent:]
            del req.output_logprobs[sent:]
            raise

    def _append(self, req: Request, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs | None]) -> Appended:
        params = req.sampling_params
        first = len(req.output_token_ids)
        new: list[int] = []
        new_lp: list[TokenLogprobs | None] = []
        text: list[str] = []
        finish: Finish | None = None
        detok = self.detokenizers.get(req.request_id)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for tok, lp in zip(tokens, logprobs, strict=True):
            req.output_token_ids.append(tok)
            new.append(tok)
            new_lp.append(lp)
            if params.logprobs is not None:
                req.output_logprobs.append(lp)
            if tok in params.stop_token_ids or tok in req.eos_token_ids:
                # the stop token's id is reported; its text is not
                if detok is not None:
                    text.append(detok.flush())
                finish = Finish(FinishReason.STOP, tok if tok in params.stop_token_ids else None)
                break
            if detok is not None:
                d = detok.add_tokens([tok])
                text.append(d.text)
                if d.stop_matched is not None:
                    finish = Finish(FinishReason.STOP, d.stop_matched)
                    break
            if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
                if detok is not None:
                    text.append(detok.flush())
                finish = Finish(FinishReason.LENGTH, None)
                break
        return Appended(new, new_lp if params.logprobs is not None else None, first, "".join(text), finish)

    def delta(self, req: Request, app: Appended, spec: SpecStats | None) -> RequestDelta:
        """What the caller sees of ``app`` (after the engine finished ``req`` when ``app`` says
        so: the delta then carries the final output)."""
        first = app.first_token_index
        return RequestDelta(
            request_id=req.request_id,
            token_ids=app.token_ids,
            first_token_index=first,
            text=app.text,
            logprobs=app.logprobs,
            finished=req.is_finished,
            finish_reason=None if req.finish_reason is None else req.finish_reason.value,
            stop_reason=req.stop_reason,
            spec=spec,
            num_prompt_tokens=req.num_prompt_tokens if first == 0 else None,
            queue_time=(
                req.first_scheduled_time - req.arrival_time
                if first == 0 and req.first_scheduled_time is not None
                else None
            ),
            final=self.final(req, spec=spec) if req.is_finished else None,
        )

    def final(self, req: Request, error: str | None = None, spec: SpecStats | None = None) -> RequestOutput:
        """The whole output of a finished request."""
        return RequestOutput.of(req, self.text(req), spec, error=error)

    def closing_delta(self, req: Request, spec: SpecStats | None, error: str | None = None) -> RequestDelta:
        """The last delta of a request finished without new tokens (aborted, or failed with
        ``error``), carrying its final output."""
        final = self.final(req, error, spec)
        return RequestDelta(
            request_id=req.request_id,
            token_ids=[],
            first_token_index=len(req.output_token_ids),
            text="",
            logprobs=None,
            finished=True,
            finish_reason=None if req.finish_reason is None else req.finish_reason.value,
            final=final,
            spec=spec if error is not None else None,
            error=error,
        )
