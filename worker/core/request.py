"""A request owns what a request is: its tokens, block table, progress, sampling parameters,
seed and timings. Its text state belongs to the OutputProcessor, its speculation state to the
SpecDecoder (each keyed by request id)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from draftwise.worker.model.block_tables import BlockTable
from draftwise.worker.sampling.sampler import SamplingRow
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.sampling.token_counts import TokenCounts

if TYPE_CHECKING:
    from collections.abc import Sequence

    from draftwise.worker.sampling.sampler import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the engine failed this request (an error of its own; the others went on)


@dataclass
class Request:
    """One generation request and everything the engine knows about it."""

    request_id: str
    prompt: str | None  # text, when the request came as text
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # effective cap on output tokens (params.max_tokens or what the context allows)
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids (ignored with ignore_eos)
    arrival_time: float = field(default_factory=time.monotonic)
    seed: int | None = None  # keys this request's randomness with each token's position (None for greedy)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    block_table: list[int] = field(default_factory=BlockTable)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    constraint_unfinished: bool = False  # finished before its constraint (SamplingParams.constraint) was complete
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_counts: TokenCounts | None = field(default=None, repr=False)  # the penalties' counts (sampling_row)
    # prefix caching (worker/core/block_manager.py): the tenant's salt, the hashes of the sequence's full
    # blocks (they depend on its tokens alone), the position this admission's prefill started at (its cached
    # prefix), how many of its blocks were offered to the cache, and the prompt tokens found cached when it was
    # first admitted (reported in its usage)
    cache_salt: str = ""
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    prefill_start: int = 0
    num_blocks_cached: int = 0
    num_cached_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: the sequence as it stands."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def sampling_row(self, drafts: Sequence[int] = ()) -> SamplingRow:
        """The sampler's view of this request, as if ``drafts`` had been appended to its output
        (speculative decoding shapes each draft position's p and q this way)."""
        return SamplingRow(
            params=self.sampling_params,
            seed=self.seed,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            eos_token_ids=self.eos_token_ids,
            drafts=drafts,
            counts=self._token_counts(),
        )

    def _token_counts(self) -> TokenCounts | None:
        """The device-side token counts the penalties read, made on first use (None without
        penalties); they grow with the output, never rebuilt."""
        p = self.sampling_params
        if p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            return None
        if self.token_counts is None:
            self.token_counts = TokenCounts()
        return self.token_counts

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt plus output, as one new list."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


class FinishedContinuation(ValueError):
    """The continuation is a whole output: the request ended at its last token (refused like any
    invalid continuation, INVALID_ARGUMENT, with why it ended: a gateway that lost the final event
    with a worker then finishes the request itself)."""

    def __init__(self, message: str, reason: str, stop_token_id: int | None = None, stop_str: str | None = None):
        super().__init__(message)
        self.reason = reason  # "length" (max_tokens or the context reached) or "stop" (EOS, a stop id or string)
        self.stop_token_id = stop_token_id
        self.stop_str = stop_str
