"""What the engine hands back: per-step named outputs and vLLM-shaped request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftwise.worker.core.request import Request
from draftwise.worker.sampling.sampler import TokenLogprobs


@dataclass(frozen=True)
class RequestMetrics:
    """Timings (``time.monotonic()`` seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding counters of one request (cumulative)."""

    proposed: int  # draft tokens proposed
    accepted: int  # of which the target accepted
    verify_steps: int  # verification rounds (steps that verified at least one draft token)
    grammar_refused: int = 0  # drafted tokens a constrained request's grammar refused (never verified as kept)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed; 0.0 while nothing was proposed."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round: 1 + accepted / verify_steps (vLLM's "mean
        acceptance length"); 0.0 before the first round."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 0.0


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # per token, when SamplingParams.logprobs is set
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    spec: SpecStats | None = None  # speculative decoding counters; None when the request did not speculate
    constraint_unfinished: bool = (
        False  # finished (by length, a stop string, an abort) before its constraint was complete
    )

    @property
    def num_spec_proposed(self) -> int:
        """Draft tokens proposed for this completion (0 without speculation)."""
        return 0 if self.spec is None else self.spec.proposed

    @property
    def num_spec_accepted(self) -> int:
        """Draft tokens the target accepted (0 without speculation)."""
        return 0 if self.spec is None else self.spec.accepted

    @property
    def spec_token_acceptance_rate(self) -> float | None:
        """num_spec_accepted / num_spec_proposed; None when nothing was proposed."""
        return None if self.spec is None or not self.spec.proposed else self.spec.acceptance_rate

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification round (1 + accepted / rounds); None without rounds."""
        return None if self.spec is None or not self.spec.verify_steps else self.spec.mean_accepted_length

    @property
    def cumulative_logprob(self) -> float | None:
        if not self.logprobs:
            return None
        return sum(lp.logprob for lp in self.logprobs if lp is not None)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # why the engine failed this request (finish_reason "error"); None otherwise
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at its first admission

    @classmethod
    def of(cls, req: Request, text: str, spec: SpecStats | None = None, error: str | None = None) -> RequestOutput:
        want_lp = req.sampling_params.logprobs is not None
        return cls(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[
                CompletionOutput(
                    index=0,
                    text=text,
                    token_ids=list(req.output_token_ids),
                    logprobs=list(req.output_logprobs) if want_lp else None,
                    finish_reason=None if req.finish_reason is None else req.finish_reason.value,
                    stop_reason=req.stop_reason,
                    spec=spec,
                    constraint_unfinished=req.constraint_unfinished,
                )
            ],
            finished=req.is_finished,
            metrics=RequestMetrics(
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finish_time=req.finish_time,
                num_preemptions=req.num_preemptions,
            ),
            error=error,
            num_cached_tokens=req.num_cached_tokens,
        )


@dataclass(frozen=True)
class RequestDelta:
    """What one request gained in one step."""

    request_id: str
    token_ids: list[int]  # new output tokens (may be empty on the final delta of an abort)
    first_token_index: int  # index in the output of token_ids[0]: receivers can spot gaps and duplicates
    text: str  # newly released text
    logprobs: list[TokenLogprobs | None] | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    final: RequestOutput | None = None  # on the finishing delta: the whole output, with usage and timings
    spec: SpecStats | None = None  # the request's speculation counters so far; None when it does not speculate
    error: str | None = None  # on a final delta with finish_reason "error": what went wrong, for the caller
    num_prompt_tokens: int | None = None  # on a request's first delta (first_token_index 0): its prompt's length
    queue_time: float | None = None  # on the first delta: seconds from arrival to first scheduled


def merge_deltas(deltas: list[RequestDelta]) -> RequestDelta:
    """Consecutive deltas of one request as one: their tokens, text and logprobs in order, the
    first one's index (and prompt size and queue time), the last one's state (finished, reasons,
    final output, cumulative speculation counters, error)."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    logprobs: list[TokenLogprobs | None] | None = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs if d.logprobs is not None else [None] * len(d.token_ids))]
    return RequestDelta(
        request_id=first.request_id,
        token_ids=[t for d in deltas for t in d.token_ids],
        first_token_index=first.first_token_index,
        text="".join(d.text for d in deltas),
        logprobs=logprobs,
        finished=last.finished,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        final=last.final,
        spec=last.spec,
        error=last.error,
        num_prompt_tokens=first.num_prompt_tokens,
        queue_time=first.queue_time,
    )


@dataclass(frozen=True)
class StepStats:
    num_scheduled: int  # requests in the batch
    num_batched_tokens: int  # tokens in the batch
    num_running: int
    num_waiting: int
    num_preempted: int  # preemptions this step
    num_free_blocks: int
    step_time: float  # seconds
    num_spec_proposed: int = 0  # draft tokens verified this step
    num_spec_accepted: int = 0  # of which accepted


@dataclass(frozen=True)
class StepOutput:
    deltas: list[RequestDelta] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)
    stats: StepStats | None = None
