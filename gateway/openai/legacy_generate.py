"""vLLM's legacy ``POST /generate`` (its ``vllm.entrypoints.api_server``), on the HTTP endpoint.

Request: a JSON object ``{"prompt": str, "stream": bool, ...}`` whose other fields are sampling
parameters under vLLM's names (:data:`SAMPLING_FIELDS`; ``max_tokens`` defaults to 16 and
``temperature`` to 1.0, as vLLM's ``SamplingParams``). A field not listed, ``n`` or ``best_of``
other than 1, or ``use_beam_search: true`` is a 400 naming it: silently ignoring it would change
what the client asked for.

Response: ``{"text": [prompt + output]}``: vLLM returns the prompt followed by the generated text,
one entry per output (one here). With ``"stream": true`` the body is a sequence of such objects,
the text so far in each, every one followed by a NUL byte (``b"\\0"``), as vLLM's legacy
streaming: a client splits on ``b"\\0"`` and reads the last chunk's ``text``. An error before the
answer starts is the endpoint's JSON error (status 400, 404, 429, 503...); one after it has
started is a last chunk ``{"error": {...}}``.

The request goes through the same parts as the OpenAI routes (checks, admission, routing,
failover, API keys): :class:`~draftwise.gateway.openai.server.OpenAIServer` registers the route
with its own body reader and relay starter (:func:`add_generate_route`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from draftwise.gateway.openai.api_error import ApiError, error_body
from draftwise.gateway.openai.api_error import show as _show
from draftwise.gateway.openai.http_errors import raise_if_error
from draftwise.gateway.openai.protocol import _sampling, check_text
from draftwise.gateway.relay import Relay
from draftwise.gateway.streams import Outbox
from draftwise.v1 import generation_pb2 as pb

SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "n",
    "best_of",
    "use_beam_search",
)
"""The sampling fields ``/generate`` takes (vLLM's ``SamplingParams`` names)."""
FIELDS = frozenset({"prompt", "stream", *SAMPLING_FIELDS})
DEFAULT_MAX_TOKENS = 16
"""vLLM's ``SamplingParams.max_tokens`` default."""
SEPARATOR = b"\0"
"""What follows every chunk of a streamed answer (vLLM's legacy streaming)."""

BodyOf = Callable[[web.Request], Awaitable[object]]
RelayOf = Callable[[web.Request, str, pb.StartGeneration, bool], tuple[Relay, Outbox, str]]
"""(request, request id, start, whole: the caller reads only the whole answer) -> a started relay."""


@dataclass(frozen=True)
class GenerateRequest:
    """A ``/generate`` body, checked."""

    start: pb.StartGeneration
    prompt: str
    stream: bool


def _one(body: dict[str, Any], name: str) -> None:
    """``n`` / ``best_of``: 1 (or absent) only."""
    v = body.get(name)
    if v is None or v == 1 and not isinstance(v, bool):
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, got {_show(v)}", name)
    raise ApiError(400, f"{name} must be 1 (got {v}): /generate returns one output per request; send several", name)


def parse_generate(raw: object) -> GenerateRequest:
    """A ``/generate`` body; ApiError(400) naming the field that is wrong (or unknown)."""
    if not isinstance(raw, dict):
        raise ApiError(400, 'the request body must be a JSON object: {"prompt": "...", "max_tokens": 16, ...}')
    check_text(raw)
    unknown = sorted(k for k in raw if k not in FIELDS)
    if unknown:
        names = ", ".join(repr(k[:40]) for k in unknown[:8])
        raise ApiError(
            400,
            f"unknown field{'s' * (len(unknown) > 1)} {names}: /generate takes prompt, stream and the sampling "
            f"fields {', '.join(SAMPLING_FIELDS)}",
            unknown[0][:40],
        )
    prompt = raw.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, f"prompt must be a non-empty string, got {_show(prompt)}", "prompt")
    stream = raw.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {_show(stream)}", "stream")
    beam = raw.get("use_beam_search")
    if beam is not None and not isinstance(beam, bool):
        raise ApiError(400, f"use_beam_search must be true or false, got {_show(beam)}", "use_beam_search")
    if beam:
        raise ApiError(
            400,
            "use_beam_search: beam search is not supported by draftwise: send use_beam_search false (or leave it "
            "out) for sampling, or temperature 0 for greedy decoding",
            "use_beam_search",
        )
    for name in ("n", "best_of"):
        _one(raw, name)
    sp = _sampling(raw, ("max_tokens",), None)  # the OpenAI routes' checks, naming the field
    if not sp.HasField("max_tokens"):
        sp.max_tokens = DEFAULT_MAX_TOKENS
    start = pb.StartGeneration(prompt=pb.Prompt(text=prompt), sampling_params=sp)
    return GenerateRequest(start, prompt, bool(stream))


def _texts(prompt: str, text: str) -> dict[str, list[str]]:
    return {"text": [prompt + text]}


async def _collect(outbox: Outbox, first: Any) -> str:
    """The generated text, read to the request's end (ApiError for its error event)."""
    parts: list[str] = []
    resp = first
    while True:
        raise_if_error(resp)
        assert resp is not None  # raise_if_error raised for None
        ev = resp.event
        kind = ev.WhichOneof("kind")
        if kind == "delta":
            parts.append(ev.delta.text)
        elif kind == "finished":
            return "".join(parts)
        resp = await outbox.get()


async def _stream(request: web.Request, parsed: GenerateRequest, outbox: Outbox, first: Any) -> web.StreamResponse:
    """vLLM's legacy stream: ``{"text": [prompt + text so far]}`` + ``b"\\0"`` per delta."""
    http = web.StreamResponse(headers={"Content-Type": "application/json", "Cache-Control": "no-cache"})
    await http.prepare(request)
    text, sent = "", False
    resp = first
    try:
        while True:
            raise_if_error(resp)
            assert resp is not None  # raise_if_error raised for None
            ev = resp.event
            kind = ev.WhichOneof("kind")
            if kind == "delta" and ev.delta.text:
                text += ev.delta.text
                await http.write(json.dumps(_texts(parsed.prompt, text)).encode() + SEPARATOR)
                sent = True
            elif kind == "finished":
                if not sent:  # nothing generated: still one chunk, the prompt
                    await http.write(json.dumps(_texts(parsed.prompt, text)).encode() + SEPARATOR)
                break
            resp = await outbox.get()
    except ApiError as e:  # after the headers: the error travels as the last chunk
        await http.write(json.dumps(error_body(e.status, e.message, e.param, e.code)).encode() + SEPARATOR)
    await http.write_eof()
    return http


async def answer(request: web.Request, parsed: GenerateRequest, relay_of: RelayOf) -> web.StreamResponse:
    """Run ``parsed`` and answer it, whole or streamed; the worker call is cancelled when the
    client leaves first."""
    relay, outbox, _model = relay_of(request, f"generate-{uuid.uuid4().hex}", parsed.start, not parsed.stream)
    try:
        first = await outbox.get()
        raise_if_error(first)  # refused before it started: the endpoint's JSON error
        if parsed.stream:
            return await _stream(request, parsed, outbox, first)
        text = await _collect(outbox, first)
        return web.Response(text=json.dumps(_texts(parsed.prompt, text)), content_type="application/json")
    finally:
        relay.cancel()  # no-op once finished; else (the client left) the worker frees its KV blocks


def add_generate_route(app: web.Application, body_of: BodyOf, relay_of: RelayOf) -> None:
    """``POST /generate`` on ``app``: bodies read with ``body_of``, requests started with ``relay_of``."""

    async def generate(request: web.Request) -> web.StreamResponse:
        return await answer(request, parse_generate(await body_of(request)), relay_of)

    app.router.add_post("/generate", generate)
