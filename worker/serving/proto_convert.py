"""Between the gRPC messages of ``draftwise.v1`` and the engine's own types."""

from __future__ import annotations

from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.wire import FINISHED_REASON_KEY, FINISHED_STOP_STR_KEY, FINISHED_STOP_TOKEN_KEY
from draftwise.worker.core.outputs import RequestDelta, SpecStats
from draftwise.worker.core.request import FinishedContinuation
from draftwise.worker.sampling.constraints import Constraint
from draftwise.worker.sampling.sampler import TokenLogprobs
from draftwise.worker.sampling.sampling_params import SPECULATIVE_METHOD_NAMES, SamplingParams
from draftwise.worker.text.chat import ChatMessage, ChatPrompt
from draftwise.worker.text.chat_tools import ToolCall, tools_from_json

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def sampling_params_from_proto(msg: pb.SamplingParams, spec: pb.SpeculationOptions | None = None) -> SamplingParams:
    """Unset optional fields take vLLM's defaults; ``spec`` (the request's speculation
    options) sets use_speculation, max_speculative_tokens and speculative_methods. ValueError (naming the field)
    when invalid."""
    kw: dict = {
        "top_k": msg.top_k,
        "min_p": msg.min_p,
        "min_tokens": msg.min_tokens,
        "stop": tuple(msg.stop),
        "stop_token_ids": tuple(msg.stop_token_ids),
        "ignore_eos": msg.ignore_eos,
        "presence_penalty": msg.presence_penalty,
        "frequency_penalty": msg.frequency_penalty,
        "include_stop_str_in_output": msg.include_stop_str_in_output,
    }
    for name in ("temperature", "top_p", "max_tokens", "seed", "repetition_penalty", "logprobs", "skip_special_tokens"):
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    constraint = constraint_from_proto(msg)
    if constraint is not None:
        kw["constraint"] = constraint
    if spec is not None:
        if spec.HasField("enabled"):
            kw["use_speculation"] = spec.enabled
        if spec.HasField("max_speculative_tokens"):
            if spec.max_speculative_tokens < 1:
                raise ValueError(f"speculation.max_speculative_tokens must be >= 1, got {spec.max_speculative_tokens}")
            kw["max_speculative_tokens"] = spec.max_speculative_tokens
        if len(spec.methods) > len(SPECULATIVE_METHOD_NAMES):
            raise ValueError(f"speculation.methods holds at most {len(SPECULATIVE_METHOD_NAMES)} names")
        if spec.methods:
            kw["speculative_methods"] = tuple(spec.methods)
    return SamplingParams(**kw)


def constraint_from_proto(msg: pb.SamplingParams) -> Constraint | None:
    """The ``constraint`` oneof (None when unset); ValueError naming the field for a malformed
    one (empty or oversized text, a schema that is not a JSON object or boolean, no choices,
    ``json_object`` false). Whether it compiles is the engine's check, at intake."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    try:
        return _constraint(msg, kind)
    except RecursionError:  # (json.loads on deeply nested arrays)
        raise ValueError(f"sampling_params.{kind}: the constraint is nested too deeply") from None
    except ValueError as e:
        raise ValueError(str(e) if kind in str(e) else f"sampling_params.{kind}: {e}") from None


def _constraint(msg: pb.SamplingParams, kind: str) -> Constraint:
    if kind == "json_object":
        if not msg.json_object:
            raise ValueError("sampling_params.json_object must be true when set (leave it unset for no constraint)")
        return Constraint.json_object()
    if kind == "choice":
        return Constraint.choice(list(msg.choice.options))
    if kind == "json_schema":
        return Constraint.json_schema(msg.json_schema)
    return Constraint.regex(msg.regex) if kind == "regex" else Constraint.grammar(msg.grammar)


def chat_from_proto(msg: pb.ChatMessages) -> ChatPrompt:
    """The conversation and its tools; ValueError naming the field for malformed tools_json,
    a tool call without a name or with arguments that are not a JSON object, a tool message
    without content."""
    messages = tuple(
        ChatMessage(
            m.role,
            m.content,
            tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
            m.tool_call_id,
            m.name,
        )
        for m in msg.messages
    )
    return ChatPrompt(messages, tools_from_json(msg.tools_json))


def prompt_from_proto(msg: pb.Prompt) -> str | list[int] | ChatPrompt:
    """Text, token ids, or chat messages (rendered later, off the event loop, by the engine)."""
    kind = msg.WhichOneof("kind")
    if kind == "text":
        return msg.text
    if kind == "token_ids":
        return list(msg.token_ids.ids)
    if kind == "chat":
        return chat_from_proto(msg.chat)
    raise ValueError("prompt is empty: set prompt.text, prompt.token_ids or prompt.chat")


def continuation_from_proto(msg: pb.StartGeneration) -> tuple[list[int], SpecStats | None]:
    """The output tokens a resubmitted request already has, and their speculation counters
    (None when unset); ([], None) for a fresh request."""
    if not msg.HasField("continuation"):
        return [], None
    c = msg.continuation
    spec = None
    if c.HasField("speculation"):
        s = c.speculation
        spec = SpecStats(s.proposed_tokens, s.accepted_tokens, s.verify_steps, s.grammar_refused_tokens)
    return list(c.output_token_ids), spec


def _logprob(lp: TokenLogprobs | None) -> pb.TokenLogprob:
    if lp is None:
        return pb.TokenLogprob()
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def events_from_delta(d: RequestDelta) -> list[pb.GenerationEvent]:
    """A delta event (when it carries tokens or text), then a finished event when it ends.
    A speculating request's delta carries its cumulative counters (``TokenDelta.speculation``);
    its finished event, the totals (``Usage.speculative_*_tokens``)."""
    return [r.event for r in responses_from_delta(d)]


def responses_from_delta(d: RequestDelta) -> list[wpb.WorkerServiceGenerateResponse]:
    """``events_from_delta`` built in place in the stream's response messages (no copies:
    this runs once per request per engine step)."""
    out = []
    if d.token_ids or d.text:
        resp = wpb.WorkerServiceGenerateResponse()
        ev = resp.event
        ev.request_id = d.request_id
        delta = ev.delta
        delta.token_ids.extend(d.token_ids)
        delta.text = d.text
        delta.first_token_index = d.first_token_index
        if d.logprobs:
            delta.logprobs.extend(_logprob(lp) for lp in d.logprobs)
        if d.spec is not None:
            fill_speculation_stats(delta.speculation, d.spec)
        if d.first_token_index == 0:
            fill_first_delta(delta, d)
        out.append(resp)
    if d.finished:
        resp = wpb.WorkerServiceGenerateResponse()
        resp.event.request_id = d.request_id
        resp.event.finished.CopyFrom(finished_from_delta(d))
        out.append(resp)
    return out


def fill_first_delta(msg: pb.TokenDelta, d: RequestDelta) -> None:
    """The prompt token count and queue time on a request's first delta, so that the gateway
    can report them in the final ABORT event of a request it cancels (it never sees the
    worker's own final event then), from the engine's RequestDelta fields
    ``num_prompt_tokens`` and ``queue_time`` (seconds), set on the first delta only."""
    if d.num_prompt_tokens:
        msg.prompt_tokens = d.num_prompt_tokens
    if d.queue_time is not None:
        msg.queue_ms = d.queue_time * 1000


def fill_speculation_stats(msg: pb.SpeculationStats, spec: SpecStats) -> None:
    """Set every field of ``msg`` (which marks it present, zeros included) from ``spec``."""
    msg.proposed_tokens = spec.proposed
    msg.accepted_tokens = spec.accepted
    msg.acceptance_rate = spec.acceptance_rate
    msg.mean_accepted_length = spec.mean_accepted_length
    msg.verify_steps = spec.verify_steps
    msg.grammar_refused_tokens = spec.grammar_refused
    msg.SetInParent()  # present even while every counter is still 0


def finished_from_delta(d: RequestDelta) -> pb.Finished:
    msg = pb.Finished(finish_reason=_FINISH.get(d.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED))
    if isinstance(d.stop_reason, str):
        msg.stop_str = d.stop_reason
    elif isinstance(d.stop_reason, int):
        msg.stop_token_id = d.stop_reason
    out = d.final
    if out is not None:
        msg.usage.prompt_tokens = len(out.prompt_token_ids)
        completion = out.outputs[0]
        msg.constraint_unfinished = completion.constraint_unfinished
        msg.usage.completion_tokens = len(completion.token_ids)
        msg.usage.speculative_proposed_tokens = completion.num_spec_proposed
        msg.usage.speculative_accepted_tokens = completion.num_spec_accepted
        # (a continuation's cached tokens may include output tokens: the prompt's are reported)
        msg.usage.cached_prompt_tokens = min(out.num_cached_tokens, msg.usage.prompt_tokens)
        m = out.metrics
        if m.queue_time is not None:
            msg.timings.queue_ms = m.queue_time * 1000
        if m.time_to_first_token is not None:
            msg.timings.time_to_first_token_ms = m.time_to_first_token * 1000
        if m.total_time is not None:
            msg.timings.total_ms = m.total_time * 1000
    return msg


def finished_metadata(e: ValueError) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata for refusing a request with ``e``: why its output ended when ``e`` says the
    continuation is a whole output (draftwise.wire), else none."""
    if not isinstance(e, FinishedContinuation):
        return ()
    md: list[tuple[str, str | bytes]] = [(FINISHED_REASON_KEY, e.reason)]
    if e.stop_token_id is not None:
        md.append((FINISHED_STOP_TOKEN_KEY, str(e.stop_token_id)))
    if e.stop_str is not None:
        md.append((FINISHED_STOP_STR_KEY, e.stop_str.encode()))
    return tuple(md)
