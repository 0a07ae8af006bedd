"""The answers of the OpenAI endpoint: a request's events (from its relay's :class:`Outbox`) read
into one response object, or written as server-sent events, as they come. Chat requests that
offered tools have their output read for tool calls (:mod:`.tool_parsers`), the same way whole or
streamed. A request whose constraint was left incomplete is logged and says so
(``constraint_unfinished`` on its choice)."""

from __future__ import annotations

import json
import re
from typing import Any

import structlog
from aiohttp import web

from draftwise.gateway.openai import protocol as P
from draftwise.gateway.openai import tool_parsers as T
from draftwise.gateway.openai.http_errors import merged, raise_if_error
from draftwise.gateway.openai.protocol import ApiError, ParsedRequest
from draftwise.gateway.streams import Outbox
from draftwise.v1 import generation_pb2 as pb

log = structlog.get_logger("draftwise.gateway.openai")


_ABOUT_CONSTRAINT = re.compile(r"\bconstraints?\b|JSON schema|json_schema", re.IGNORECASE)


def name_constraint(e: ApiError, parsed: ParsedRequest) -> ApiError:
    """``e`` naming the request's constraint field as its ``param`` when it is a worker's refusal
    of that constraint (a 400 without a param whose message is about the constraint)."""
    if e.status == 400 and e.param is None and parsed.constraint_param and _ABOUT_CONSTRAINT.search(e.message):
        e.param = parsed.constraint_param
    return e


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _finish(rid: str, fin: pb.Finished, calls: int = 0) -> dict[str, Any]:
    fields = P.finish_fields(fin, calls)
    if fin.constraint_unfinished:
        log.info(
            "constraint unfinished: the output ended before its constraint was complete",
            request_id=rid,
            finish_reason=fields["finish_reason"],
            completion_tokens=fin.usage.completion_tokens,
        )
    return fields


def response(
    rid: str, chat: bool, model: str, choices: list[dict[str, Any]], usage: pb.Usage, spec: pb.SpeculationStats | None
) -> dict[str, Any]:
    body = P.envelope(rid, "chat.completion" if chat else "text_completion", model)
    body["choices"] = choices
    body["usage"] = P.usage(usage)
    if spec is not None:
        body["speculation"] = P.speculation(spec)
    return body


async def collect(
    rid: str, parsed: ParsedRequest, chat: bool, outbox: Outbox, first: Any
) -> tuple[dict[str, Any], pb.Usage, pb.SpeculationStats | None]:
    """One request's choice (``index`` 0), usage and speculation counters, read to its end."""
    if first is None:
        first = await outbox.get()
    text: list[str] = []
    logprobs: list[pb.TokenLogprob] = []
    spec: pb.SpeculationStats | None = None
    resp = first
    while True:
        raise_if_error(resp)
        assert resp is not None  # _raise_if_error raised for None
        ev = resp.event
        if ev.WhichOneof("kind") == "delta":
            text.append(ev.delta.text)
            logprobs.extend(ev.delta.logprobs)
            if ev.delta.HasField("speculation"):
                spec = ev.delta.speculation
        elif ev.WhichOneof("kind") == "finished":
            break
        resp = await outbox.get()
    fin = ev.finished
    choice: dict[str, Any] = {"index": 0}
    calls = 0
    if chat:
        if parsed.tools is None:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["message"] = T.message(parsed.tools, "".join(text))
            calls = len(choice["message"].get("tool_calls", ()))
        choice["logprobs"] = P.chat_logprobs(logprobs) if parsed.logprobs else None
    else:
        choice["text"] = "".join(text)
        choice["logprobs"] = P.completion_logprobs(logprobs) if parsed.logprobs else None
    choice.update(_finish(rid, fin, calls))
    return choice, fin.usage, spec


async def stream(
    request: web.Request, parsed: ParsedRequest, chat: bool, rid: str, model: str, outbox: Outbox, first: Any
) -> web.StreamResponse:
    """One request's answer as server-sent events, then ``[DONE]``."""
    http = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await http.prepare(request)
    base = P.envelope(rid, "chat.completion.chunk" if chat else "text_completion", model)
    parser = T.new_parser(parsed.tools) if chat and parsed.tools is not None else None

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        out = dict(base, choices=[] if choice is None else [dict(index=0, **choice)])
        if parsed.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    if chat:
        await http.write(
            sse(chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}))
        )
    resp = first
    held: dict[str, Any] = {}  # speculation counters not yet sent (their delta's text was held back)
    try:
        while resp is not None:
            raise_if_error(resp)
            ev = resp.event
            kind = ev.WhichOneof("kind")
            if kind == "delta":
                d = ev.delta
                if d.HasField("speculation"):  # cumulative: the latest is the one to send
                    held["speculation"] = P.speculation(d.speculation)
                lp = list(d.logprobs) if parsed.logprobs else None
                if chat:
                    delta = T.delta(parser.feed(d.text)) if parser is not None else {"content": d.text}
                    if parser is None or delta or lp:  # with tools, text held back sends nothing (yet)
                        c = {"delta": delta, "logprobs": P.chat_logprobs(lp) if lp is not None else None}
                        await http.write(sse(chunk(dict(c, finish_reason=None), **held)))
                        held.clear()
                else:
                    c = {"text": d.text, "logprobs": P.completion_logprobs(lp) if lp is not None else None}
                    await http.write(sse(chunk(dict(c, finish_reason=None), **held)))
                    held.clear()
            elif kind == "finished":
                fin = ev.finished
                if parser is not None:
                    rest = T.delta(parser.finish())
                    if rest:
                        await http.write(sse(chunk({"delta": rest, "logprobs": None, "finish_reason": None}, **held)))
                        held.clear()
                c = {"delta": {}} if chat else {"text": ""}
                fields = _finish(rid, fin, parser.calls if parser is not None else 0)
                await http.write(sse(chunk(dict(c, logprobs=None, **fields), **held)))
                if parsed.include_usage:
                    await http.write(sse(dict(chunk(None), usage=P.usage(fin.usage))))
                break
            resp = await outbox.get()
    except ApiError as e:  # after the headers: the error travels as an event
        await http.write(sse(P.error_body(e.status, e.message, e.param, e.code)))
    await http.write(b"data: [DONE]\n\n")
    await http.write_eof()
    return http


async def stream_batch(
    request: web.Request, parsed: ParsedRequest, rid: str, model: str, outboxes: list[Outbox]
) -> web.StreamResponse:
    """A batch of completions streamed: the prompts' chunks interleaved, each with its ``index``."""
    http = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await http.prepare(request)
    base = P.envelope(rid, "text_completion", model)
    extra = {"usage": None} if parsed.include_usage else {}
    total = pb.Usage()
    try:
        async for i, resp in merged(outboxes):
            raise_if_error(resp)
            ev = resp.event
            if ev.WhichOneof("kind") == "delta":
                lp = P.completion_logprobs(list(ev.delta.logprobs)) if parsed.logprobs else None
                choice = {"index": i, "text": ev.delta.text, "logprobs": lp, "finish_reason": None}
            else:
                fin = ev.finished
                P.add_usage(total, fin.usage)
                choice = {"index": i, "text": "", "logprobs": None, **_finish(f"{rid}-{i}", fin)}
            await http.write(sse(dict(base, choices=[choice], **extra)))
        if parsed.include_usage:
            await http.write(sse(dict(base, choices=[], usage=P.usage(total))))
    except ApiError as e:  # after the headers: the error travels as an event
        await http.write(sse(P.error_body(e.status, e.message, e.param, e.code)))
    await http.write(b"data: [DONE]\n\n")
    await http.write_eof()
    return http
