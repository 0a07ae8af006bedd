"""The client's own types: sampling parameters, deltas, completions and errors, as plain
frozen dataclasses (no protobuf in the public API)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from draftwise_client._constraint import Constraint
from draftwise_client._proto import generate_service_pb2 as gspb
from draftwise_client._proto import generation_pb2 as pb
from draftwise_client._retry import hint_from_metadata

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
_CODES = {c.value[0]: c for c in grpc.StatusCode}


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's names and meanings; None leaves a field to the server's default."""

    max_tokens: int | None = None  # server default 16
    temperature: float | None = None  # server default 1.0; 0 is greedy
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logprobs: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    speculation: bool | None = None  # False: no speculative decoding for this request; None: the server's choice
    max_speculative_tokens: int | None = None  # cap on the tokens drafted per step (>= 1)
    speculative_methods: tuple[str, ...] | None = None  # draft with these proposers only ("draft", "suffix", ...)
    constraint: Constraint | None = None  # structured output: what the output must match (see Constraint)

    def to_proto(self) -> pb.SamplingParams:
        msg = pb.SamplingParams(
            top_k=self.top_k,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        for name in ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(msg, name, value)
        if self.skip_special_tokens is not None:
            msg.skip_special_tokens = self.skip_special_tokens
        if self.constraint is not None:
            self.constraint.fill(msg)
        return msg

    def speculation_proto(self) -> pb.SpeculationOptions | None:
        """The request's SpeculationOptions, None when it leaves speculation to the server."""
        if self.speculation is None and self.max_speculative_tokens is None and not self.speculative_methods:
            return None
        msg = pb.SpeculationOptions()
        if self.speculation is not None:
            msg.enabled = self.speculation
        if self.max_speculative_tokens is not None:
            msg.max_speculative_tokens = self.max_speculative_tokens
        msg.methods.extend(self.speculative_methods or ())
        return msg


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    speculative_proposed_tokens: int = 0
    speculative_accepted_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV the worker reused from its prefix cache


@dataclass(frozen=True)
class SpeculationStats:
    """A speculating request's counters so far (cumulative)."""

    proposed_tokens: int
    accepted_tokens: int
    acceptance_rate: float  # accepted / proposed
    mean_accepted_length: float  # tokens per verification step: 1 + accepted / verify_steps
    verify_steps: int
    grammar_refused_tokens: int = 0  # of the proposed tokens, those a constraint's grammar refused


@dataclass(frozen=True)
class Delta:
    """New output of one request. The last delta of a request has ``finish_reason`` set
    ("stop", "length" or "abort"), carries its usage, and usually no new tokens."""

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    first_token_index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    speculation: SpeculationStats | None = None  # on deltas of a speculating request
    resume_handle: str = ""  # on a request's first delta: what a reconnecting client resumes it with
    constraint_unfinished: bool = False  # on the last delta: it ended before its constraint was complete

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Completion:
    """A whole request's output (what ``complete`` returns)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = field(default=())
    constraint_unfinished: bool = False  # it ended (length, a stop string, abort) before its constraint was complete


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    has_draft: bool = False
    speculative_method: str = ""  # "draft" | "ngram" | "eagle" | "medusa" | "suffix" | "" (none)
    draft_model: str = ""  # the draft model's or EAGLE/Medusa head's name; "" for ngram, suffix or none
    num_speculative_tokens: int = 0

    @classmethod
    def from_proto(cls, m: gspb.ModelInfo) -> ModelInfo:
        method = {
            gspb.SPECULATIVE_METHOD_DRAFT_MODEL: "draft",
            gspb.SPECULATIVE_METHOD_NGRAM: "ngram",
            gspb.SPECULATIVE_METHOD_EAGLE: "eagle",
            gspb.SPECULATIVE_METHOD_MEDUSA: "medusa",
            gspb.SPECULATIVE_METHOD_SUFFIX: "suffix",
        }
        return cls(
            m.name,
            m.max_model_len,
            m.has_draft,
            method.get(m.speculative_method, ""),
            m.draft_model,
            m.num_speculative_tokens,
        )


class GenerationError(Exception):
    """A request failed: ``code`` is the gRPC status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
    UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED, ...), ``message`` says what to do,
    ``retry_after_ms`` is the server's retry hint (None without one). ``attempts`` counts
    the tries made, retries included; ``resumes`` the reconnections after a dropped connection."""

    def __init__(
        self, code: grpc.StatusCode, message: str, request_id: str = "", retry_after_ms: int | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.retry_after_ms = retry_after_ms
        self.attempts = 1
        self.resumes = 0

    @classmethod
    def from_rpc(cls, e: grpc.RpcError, request_id: str = "") -> GenerationError:
        trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
        return cls(e.code(), e.details() or "", request_id, hint_from_metadata(trailing))

    @classmethod
    def from_event(cls, request_id: str, err: pb.RequestError) -> GenerationError:
        code = _CODES.get(err.code, grpc.StatusCode.UNKNOWN)
        retry = None
        if err.retry_after_ms:
            retry = err.retry_after_ms
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after " in err.message:
            tail = err.message.split("retry after ", 1)[1].split(" ", 1)[0]
            retry = int(tail) if tail.isdigit() else None
        return cls(code, err.message, request_id, retry)


def chat_prompt(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> pb.Prompt:
    """Chat messages (``{"role": ..., "content": ...}`` dicts, oldest first; an assistant's
    ``tool_calls`` and a tool result's ``tool_call_id`` and ``name`` as OpenAI has them) and
    OpenAI-style function ``tools`` as a prompt the server renders with the model's chat
    template; ValueError for a malformed list (the server checks the rest)."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content") or ""
        call_id, name = m.get("tool_call_id") or "", m.get("name") or ""
        if not all(isinstance(v, str) for v in (role, content, call_id, name)):
            raise ValueError(f"messages[{i}]: 'role', 'content', 'tool_call_id' and 'name' must be strings")
        msg = pb.ChatMessage(role=role, content=content, tool_call_id=call_id, name=name)
        for j, call in enumerate(m.get("tool_calls") or ()):
            msg.tool_calls.append(_tool_call(call, f"messages[{i}].tool_calls[{j}]"))
        out.append(msg)
    prompt = pb.Prompt(chat=pb.ChatMessages(messages=out))
    if tools:
        prompt.chat.tools_json = json.dumps(list(tools))
    return prompt


def _tool_call(call: object, where: str) -> pb.ToolCall:
    """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}`` (arguments
    JSON text, or a dict)."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(call, Mapping) or not isinstance(fn, Mapping):
        raise ValueError(f"{where} must be a dict {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments") or ""
    if isinstance(args, Mapping):
        args = json.dumps(args)
    return pb.ToolCall(id=call.get("id") or "", name=fn.get("name") or "", arguments=args)


def start_message(
    prompt: str | Sequence[int] | pb.Prompt, params: SamplingParams | None, model: str, request_id: str
) -> pb.StartGeneration:
    if isinstance(prompt, pb.Prompt):
        p = prompt
    elif isinstance(prompt, str):
        p = pb.Prompt(text=prompt)
    else:
        p = pb.Prompt(token_ids=pb.TokenIds(ids=list(prompt)))
    msg = pb.StartGeneration(request_id=request_id, model=model, prompt=p)
    if params is not None:
        msg.sampling_params.CopyFrom(params.to_proto())
        spec = params.speculation_proto()
        if spec is not None:
            msg.speculation.CopyFrom(spec)
    return msg


def _logprobs(items: Sequence[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(lp.token_id, lp.logprob, lp.rank, tuple((t.token_id, t.logprob) for t in lp.top_logprobs))
        for lp in items
    )


def _speculation(s: pb.SpeculationStats) -> SpeculationStats:
    return SpeculationStats(
        s.proposed_tokens,
        s.accepted_tokens,
        s.acceptance_rate,
        s.mean_accepted_length,
        s.verify_steps,
        s.grammar_refused_tokens,
    )


def delta_from_event(event: pb.GenerationEvent) -> Delta:
    """A Delta from a delta or finished event (error events are raised by the caller)."""
    if event.WhichOneof("kind") == "delta":
        d = event.delta
        return Delta(
            request_id=event.request_id,
            text=d.text,
            token_ids=tuple(d.token_ids),
            first_token_index=d.first_token_index,
            logprobs=_logprobs(d.logprobs),
            speculation=_speculation(d.speculation) if d.HasField("speculation") else None,
            resume_handle=d.resume_handle,
        )
    f = event.finished
    which = f.WhichOneof("stop_reason")
    u = f.usage
    return Delta(
        request_id=event.request_id,
        first_token_index=u.completion_tokens,
        finish_reason=_FINISH.get(f.finish_reason, "stop"),
        stop_reason=getattr(f, which) if which else None,
        usage=Usage(
            u.prompt_tokens,
            u.completion_tokens,
            u.speculative_proposed_tokens,
            u.speculative_accepted_tokens,
            u.cached_prompt_tokens,
        ),
        constraint_unfinished=f.constraint_unfinished,
    )


class Collector:
    """Accumulates deltas into a Completion."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.last: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.last = delta

    def result(self) -> Completion:
        last = self.last
        if last is None or last.finish_reason is None:
            raise GenerationError(grpc.StatusCode.UNKNOWN, "the stream ended without a final event")
        return Completion(
            request_id=last.request_id,
            text="".join(self.text),
            token_ids=tuple(self.token_ids),
            finish_reason=last.finish_reason,
            usage=last.usage,
            logprobs=tuple(self.logprobs),
            constraint_unfinished=last.constraint_unfinished,
        )
