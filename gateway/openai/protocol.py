"""OpenAI's JSON shapes: request bodies of ``/v1/completions`` and ``/v1/chat/completions``
turned into a ``StartGeneration``, and the gateway's events turned into OpenAI responses,
stream chunks and errors. Plain functions over dicts and protobuf messages: no I/O here."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from draftwise.chat_content import text_content
from draftwise.gateway.openai.api_error import ERROR_TYPES, ApiError, error_body
from draftwise.gateway.openai.api_error import show as _show
from draftwise.gateway.openai.structured import ConstraintSpec, constraint_from_body, one_constraint
from draftwise.gateway.openai.tools import ToolPlan, fill_message, parse_tools
from draftwise.gateway.sampling_check import FieldError, check_sampling
from draftwise.v1 import generation_pb2 as pb

__all__ = ["ERROR_TYPES", "ApiError", "error_body"]  # re-exported: the server's imports of them stay here

MAX_STOP = 16
"""Most stop strings one request may carry."""
MAX_PROMPTS = 64
"""Most prompts one ``/v1/completions`` request may batch (each takes an admission slot)."""
SEED_RANGE = (-(2**63), 2**63 - 1)
"""Seeds the contract carries (int64)."""

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}

REFUSED_FIELDS: dict[str, str] = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix (insertion) is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}
"""Fields refused when set to anything but null/empty, with the reason (silently ignoring them
would change what the client asked for)."""


@dataclass(frozen=True)
class ParsedRequest:
    """A request body, checked: what to start, and how to answer."""

    start: pb.StartGeneration
    stream: bool
    include_usage: bool
    logprobs: bool  # chat: logprobs requested; completions: logprobs is not None
    starts: tuple[pb.StartGeneration, ...] = ()
    """Completions with a list of prompts: one request per prompt (choice ``index`` i); else empty."""
    tools: ToolPlan | None = None
    """Chat with tools offered: how to read the output for tool calls (None: plain text)."""
    constraint_param: str | None = None
    """The field the request's output constraint came from (named when a worker refuses it)."""


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, got {_show(v)}", name)
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{name} must be {bound}, got {v}", name)
    return v


def _float(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    try:
        ok = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        ok = False
    if not ok:
        raise ApiError(400, f"{name} must be a number (finite), got {_show(v)}", name)
    return float(v)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true or false, got {_show(v)}", name)
    return v


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, why in REFUSED_FIELDS.items():
        if body.get(name) not in (None, [], {}, ""):
            raise ApiError(400, f"{name}: {why} by this server", name)
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(400, f"n must be 1 (got {n}): this server returns one choice per request; send several", "n")
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != 1:
        raise ApiError(400, f"best_of must be 1 (got {best_of})", "best_of")


def _sampling(
    body: dict[str, Any], max_tokens_names: tuple[str, ...], constraint: ConstraintSpec | None
) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        v = _float(body, name)
        if v is not None:
            setattr(sp, name, v)
    for name in max_tokens_names:
        v = _int(body, name, 1, 2**32 - 1)
        if v is not None:
            sp.max_tokens = v
    for name, lo in (("top_k", -1), ("min_tokens", 0)):
        v = _int(body, name, lo, 2**31 - 1)
        if v is not None:
            setattr(sp, name, v)
    seed = _int(body, "seed", *SEED_RANGE)
    if seed is not None:
        sp.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "stop must be a string or a list of strings", "stop")
        if len(stop) > MAX_STOP:
            raise ApiError(400, f"stop has {len(stop)} strings; at most {MAX_STOP}", "stop")
        if any(not s for s in stop):
            raise ApiError(400, "stop strings must not be empty", "stop")
        sp.stop.extend(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_token_id(t) for t in ids):
            raise ApiError(
                400, f"stop_token_ids must be a list of integers in [0, {2**32}) (token ids)", "stop_token_ids"
            )
        sp.stop_token_ids.extend(ids)
    sp.ignore_eos = _bool(body, "ignore_eos")
    if body.get("skip_special_tokens") is not None:
        sp.skip_special_tokens = _bool(body, "skip_special_tokens")
    if constraint is not None:
        set_constraint(sp, constraint)
    try:
        check_sampling(sp)  # the gateway's shared check (the worker's ranges), naming the field
    except FieldError as e:
        param = constraint.param if constraint is not None and e.param in CONSTRAINT_FIELDS else e.param
        raise ApiError(400, e.message, param) from None
    return sp


CONSTRAINT_FIELDS = frozenset({"constraint", "json_schema", "json_object", "regex", "grammar", "choice"})
"""The contract's names of the constraint oneof (a FieldError naming one is about the request's constraint field)."""


def set_constraint(sp: pb.SamplingParams, c: ConstraintSpec) -> None:
    """``c`` as ``sp``'s constraint oneof."""
    if c.kind == "choice":
        sp.choice.options.extend(c.value)
    elif c.kind == "json_object":
        sp.json_object = True
    else:
        assert isinstance(c.value, str)
        setattr(sp, c.kind, c.value)


def _token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    return _bool(opts, "include_usage")


def check_text(body: object) -> None:
    """ApiError(400) naming the field of the first string (or key) that is not valid Unicode text:
    JSON's ``\\ud800`` escapes decode to lone surrogates, which no UTF-8 encoder takes."""
    todo: list[tuple[object, str]] = [(body, "")]
    while todo:
        v, where = todo.pop()
        if isinstance(v, str):
            _utf8(v, where)
        elif isinstance(v, dict):
            for k, item in v.items():
                _utf8(k, f"{where}.<key>".lstrip("."))
                todo.append((item, f"{where}.{k}".lstrip(".")))
        elif isinstance(v, list):
            todo.extend((item, f"{where}[{i}]") for i, item in enumerate(v))


def _utf8(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = where.encode("utf-8", "backslashreplace").decode() or None
        raise ApiError(
            400, f"{param or 'the body'} is not valid Unicode text: a lone surrogate at character {e.start}", param
        ) from None


def _common(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_text(body)
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    return body


def parse_completion(raw: object) -> ParsedRequest:
    """A ``/v1/completions`` body; ApiError(400) naming the field that is wrong. A list of
    prompts (strings or lists of token ids) is a batch: ``starts`` holds one request per prompt."""
    body = _common(raw)
    if _bool(body, "echo"):
        raise ApiError(400, "echo is not supported", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", "prompt")
        prompts = [_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        prompts = [_prompt(prompt, "prompt")]
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, [], ""):
            raise ApiError(400, f"{name}: tool calling is served by /v1/chat/completions, not completions", name)
    constraint = constraint_from_body(body)
    sp = _sampling(body, ("max_tokens",), constraint)
    if not sp.HasField("max_tokens"):
        sp.max_tokens = 16  # OpenAI's default for completions
    lp = _int(body, "logprobs", 0, 20)
    if lp is not None:
        sp.logprobs = lp
    stream = _bool(body, "stream")
    model = body.get("model") or ""
    starts = tuple(pb.StartGeneration(model=model, prompt=p, sampling_params=sp) for p in prompts)
    param = constraint.param if constraint is not None else None
    return ParsedRequest(starts[0], stream, _stream_options(body, stream), lp is not None, starts, None, param)


def _prompt(prompt: object, where: str) -> pb.Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, f"{where} is empty", where)
        return pb.Prompt(text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(_token_id(t) for t in prompt):
            raise ApiError(400, f"{where}: token ids must be non-negative integers below 2**32", where)
        return pb.Prompt(token_ids=pb.TokenIds(ids=prompt))
    raise ApiError(
        400, f"{where} must be a non-empty string or a list of token ids (or a list of those: a batch)", where
    )


def parse_chat(raw: object) -> ParsedRequest:
    """A ``/v1/chat/completions`` body; ApiError(400) naming the field that is wrong."""
    body = _common(raw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    chat = pb.ChatMessages()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with role and content", where)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"{where}.role must be a non-empty string", f"{where}.role")
        msg = chat.messages.add(role=role, content=_content(m.get("content"), f"{where}.content"))
        fill_message(msg, m, where)
    tools = parse_tools(body)
    chat.tools_json = tools.tools_json
    constraint = one_constraint([c for c in (constraint_from_body(body), tools.constraint) if c is not None])
    sp = _sampling(body, ("max_tokens", "max_completion_tokens"), constraint)
    want_lp = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not want_lp:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if want_lp:
        sp.logprobs = top or 0
    stream = _bool(body, "stream")
    start = pb.StartGeneration(model=body.get("model") or "", prompt=pb.Prompt(chat=chat), sampling_params=sp)
    param = constraint.param if constraint is not None else None
    return ParsedRequest(start, stream, _stream_options(body, stream), want_lp, (), tools.plan, param)


def _content(content: object, where: str) -> str:
    try:
        return text_content(content, where)
    except ValueError as e:
        raise ApiError(400, str(e), where) from None


# ---------------------------------------------------------------------- responses


def token_name(token_id: int) -> str:
    """How a token is named in logprobs: the gateway holds no tokenizer, so by id (vLLM's
    ``--return-tokens-as-token-ids`` convention)."""
    return f"token_id:{token_id}"


def completion_logprobs(items: list[pb.TokenLogprob]) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object."""
    return {
        "tokens": [token_name(lp.token_id) for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{token_name(t.token_id): t.logprob for t in lp.top_logprobs} for lp in items],
        "text_offset": None,
    }


def chat_logprobs(items: list[pb.TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...]}``."""
    return {
        "content": [
            {
                "token": token_name(lp.token_id),
                "logprob": lp.logprob,
                "bytes": None,
                "top_logprobs": [
                    {"token": token_name(t.token_id), "logprob": t.logprob, "bytes": None} for t in lp.top_logprobs
                ],
            }
            for lp in items
        ]
    }


def speculation(s: pb.SpeculationStats | None) -> dict[str, Any] | None:
    """The ``speculation`` extension field; None when the request did not speculate."""
    if s is None:
        return None
    return {
        "proposed_tokens": s.proposed_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "verify_steps": s.verify_steps,
        "grammar_refused_tokens": s.grammar_refused_tokens,
    }


def usage(u: pb.Usage) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV the
    worker reused from its prefix cache."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def add_usage(total: pb.Usage, u: pb.Usage) -> None:
    """Add ``u``'s token counts to ``total`` (a batch's usage is its requests' summed)."""
    total.prompt_tokens += u.prompt_tokens
    total.completion_tokens += u.completion_tokens
    total.cached_prompt_tokens += u.cached_prompt_tokens


def finish_reason(f: pb.Finished) -> str:
    return _FINISH.get(f.finish_reason, "stop")


def finish_fields(f: pb.Finished, calls: int = 0) -> dict[str, Any]:
    """A choice's ``finish_reason``: ``tool_calls`` when the output made ``calls`` tool calls and
    ended on its own (``length`` stays ``length``: a call may be cut short); and, when the request's
    constraint was left incomplete (max_tokens or a stop string came first: the output does not
    parse as asked), the extension field ``constraint_unfinished: true``."""
    reason = finish_reason(f)
    out: dict[str, Any] = {"finish_reason": "tool_calls" if calls and reason == "stop" else reason}
    if f.constraint_unfinished:
        out["constraint_unfinished"] = True
    return out


def envelope(rid: str, obj: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}
