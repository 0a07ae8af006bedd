"""The cases of the fuzz suite (``test_fuzz.py``): what is sent, on which RPC and gateway,
and which outcomes each kind of case allows. Sampling parameters and prompts come from
hypothesis (derandomized) with an oracle written from ``generation.proto``; everything else
from the seeded generator the caller passes in."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb
from tests.integration.procs import MAX_MODEL_LEN, ROOT
from tests.integration.prompts import BASES
from tests.reliability.conftest import RST_STREAM, field_bytes, field_varint

N_PARAM_CASES = 1300
"""Hypothesis-generated sampling parameter / prompt combinations."""
VOCAB_SIZE = json.loads((ROOT / "worker/default_models/target/config.json").read_text())["vocab_size"]
BIDI_BATCH = 40
"""Requests per multiplexed stream."""
CALL_TIMEOUT_S = 60.0
RAW_TIMEOUT_S = 30.0
"""Deadline of calls carrying undecodable bytes: a call still open then has hung (generous:
they run at concurrency 32 beside multi-megabyte messages, on a gateway that may be backlogged)."""

OK, ABORT, NO_EVENT, MISSING = "OK", "ABORT", "NO_EVENT", "MISSING"
IA, DE = "INVALID_ARGUMENT", "DEADLINE_EXCEEDED"


@dataclass
class Msg:
    """One client message, counted as one case (unless ``expect`` is "ignore")."""

    kind: str
    wire: bytes
    """A serialized GenerateRequest (GenerateStreamRequest has the same field number: same bytes)."""
    allowed: frozenset[str]
    rid: str = ""
    expect: str = "final"
    """final: the events with ``rid`` end in one of ``allowed`` (duplicates: outcomes joined
    with "+"); none: no event carries ``rid``; anon: one error event with an empty id;
    ignore: not counted (a filler in a call whose own status is the case)."""


@dataclass
class Call:
    """One RPC: a Generate stream carrying ``messages`` or a GenerateStream with one."""

    rpc: str  # "bidi" | "stream"
    gateway: str
    messages: list[Msg]
    timeout: float = CALL_TIMEOUT_S
    kind: str = "stream_end"
    """Bidi: the kind under which the call's own status is counted."""
    allowed: frozenset[str] = frozenset({OK})
    """Bidi: allowed call statuses."""


def allow(*outcomes: str) -> frozenset[str]:
    return frozenset(outcomes)


# -- building requests --------------------------------------------------------------------


def text_prompt(text: str) -> pb.Prompt:
    return pb.Prompt(text=text)


def ids_prompt(ids: list[int]) -> pb.Prompt:
    return pb.Prompt(token_ids=pb.TokenIds(ids=ids))


def start_msg(
    rid: str,
    prompt: pb.Prompt | None,
    params: dict | None = None,
    model: str = "",
    spec: dict | None = None,
) -> bytes:
    s = pb.StartGeneration(request_id=rid, model=model, sampling_params=pb.SamplingParams(**(params or {})))
    if prompt is not None:
        s.prompt.CopyFrom(prompt)
    if spec is not None:
        s.speculation.CopyFrom(pb.SpeculationOptions(**spec))
    return gspb.GenerateRequest(start=s).SerializeToString()


def raw_start(rid: str, prompt: bytes, params: bytes) -> bytes:
    """A GenerateRequest.start built from raw StartGeneration fields."""
    start = field_bytes(1, rid.encode()) + field_bytes(3, prompt) + field_bytes(4, params)
    return field_bytes(1, start)


SMALL = {"max_tokens": 2, "temperature": 0.0}


def short_prompt(rng: random.Random) -> pb.Prompt:
    return text_prompt(rng.choice(BASES))


# -- hypothesis: sampling parameters and prompts, with an oracle ----------------------------

ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)

# field -> (strategy of valid values, strategy of any values; None in either: leave it unset)
FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "temperature": (
        st.one_of(st.none(), st.sampled_from([0.0, 1e-6, 0.7, 1.0]), st.floats(0, 5)),
        st.one_of(st.sampled_from([-1.0, -1e-9]), st.floats(-3, 3), ANY_FLOAT),
    ),
    "top_p": (
        st.one_of(st.none(), st.floats(0, 1, exclude_min=True)),
        st.one_of(st.sampled_from([0.0, 1.0000001]), st.floats(-1, 2), ANY_FLOAT),
    ),
    "top_k": (st.integers(-1, 100), st.one_of(st.integers(-3, 50), st.integers(-(2**31), 2**31 - 1))),
    "min_p": (st.floats(0, 1), st.one_of(st.floats(-0.5, 1.5), ANY_FLOAT)),
    "max_tokens": (st.one_of(st.none(), st.integers(1, 4)), st.integers(0, 4)),
    "min_tokens": (st.integers(0, 1), st.integers(0, 40)),
    "stop": (st.lists(st.text(min_size=1, max_size=8), max_size=4), st.lists(st.text(max_size=8), max_size=4)),
    "stop_token_ids": (st.lists(st.integers(0, 2**32 - 1), max_size=4), st.lists(st.integers(0, 2**32 - 1))),
    "ignore_eos": (st.booleans(), st.booleans()),
    "seed": (st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), st.integers(-(2**63), 2**63 - 1)),
    "presence_penalty": (st.floats(-2, 2), st.one_of(st.floats(-3, 3), ANY_FLOAT)),
    "frequency_penalty": (st.floats(-2, 2), st.one_of(st.floats(-3, 3), ANY_FLOAT)),
    "repetition_penalty": (
        st.one_of(st.none(), st.floats(0, 3, exclude_min=True)),
        st.one_of(st.sampled_from([0.0, -1.0]), st.floats(-3, 3), ANY_FLOAT),
    ),
    "logprobs": (st.one_of(st.none(), st.integers(0, 20)), st.integers(0, 2**32 - 1)),
    "skip_special_tokens": (st.one_of(st.none(), st.booleans()), st.booleans()),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
}
PROMPTS = (
    st.one_of(
        st.text(min_size=1, max_size=60).map(text_prompt),
        st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40).map(ids_prompt),
    ),
    st.one_of(
        st.none(),
        st.text(max_size=60).map(text_prompt),
        st.lists(st.integers(0, VOCAB_SIZE + 100), max_size=40).map(ids_prompt),
    ),
)
SPECULATION = (
    st.one_of(
        st.none(),
        st.fixed_dictionaries({}, optional={"enabled": st.booleans(), "max_speculative_tokens": st.integers(1, 40)}),
    ),
    st.fixed_dictionaries({}, optional={"enabled": st.booleans(), "max_speculative_tokens": st.integers(0, 40)}),
)


@st.composite
def param_specs(draw: st.DrawFn) -> tuple[pb.Prompt | None, dict, dict | None]:
    """Every field valid, except at most one drawn from anything (about half the cases)."""
    wild = draw(st.sampled_from([None] * 12 + ["prompt", "speculation", *FIELDS]))
    prompt = draw(PROMPTS[wild == "prompt"])
    params = {name: draw(strats[wild == name]) for name, strats in FIELDS.items()}
    spec = draw(SPECULATION[wild == "speculation"])
    return prompt, {k: v for k, v in params.items() if v is not None}, spec


def _finite_in(v: float, ok: Callable[[float], bool]) -> bool:
    return math.isfinite(v) and ok(v)


def params_valid(prompt: pb.Prompt | None, p: dict, spec: dict | None) -> bool:
    """The contract of draftwise.v1.SamplingParams and Prompt (generation.proto)."""
    kind = None if prompt is None else prompt.WhichOneof("kind")
    if kind is None or (kind == "text" and not prompt.text) or (kind == "token_ids" and not prompt.token_ids.ids):
        return False
    if kind == "token_ids" and max(prompt.token_ids.ids) >= VOCAB_SIZE:
        return False
    max_tokens = p.get("max_tokens", 16)
    checks = [
        _finite_in(p.get("temperature", 1.0), lambda v: v >= 0),
        _finite_in(p.get("top_p", 1.0), lambda v: 0 < v <= 1),
        p["top_k"] >= -1,
        _finite_in(p["min_p"], lambda v: 0 <= v <= 1),
        max_tokens >= 1,
        p["min_tokens"] <= max_tokens,
        all(p["stop"]),
        _finite_in(p["presence_penalty"], lambda v: -2 <= v <= 2),
        _finite_in(p["frequency_penalty"], lambda v: -2 <= v <= 2),
        _finite_in(p.get("repetition_penalty", 1.0), lambda v: v > 0),
        p.get("logprobs", 0) <= 20,
        not spec or spec.get("max_speculative_tokens", 1) >= 1,
    ]
    return all(checks)


def hypothesis_params(n: int) -> list[tuple[pb.Prompt | None, dict, dict | None]]:
    """``n`` generated combinations, the same on every run."""
    out: list[tuple[pb.Prompt | None, dict, dict | None]] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(param_specs())
    def collect(case: tuple[pb.Prompt | None, dict, dict | None]) -> None:
        out.append(case)

    collect()
    return out


# -- the cases ----------------------------------------------------------------------------


def build_calls(rng: random.Random) -> list[Call]:
    """Every call of the suite, in a seeded random order."""
    gws = ("plain", "spec")
    bidi: dict[str, list[list[Msg]]] = {g: [] for g in gws}  # groups kept together on one stream, in order
    streams: list[Call] = []
    calls: list[Call] = []
    counter = iter(range(10**9))

    def rid(kind: str) -> str:
        return f"{kind}-{next(counter)}"

    def add(
        kind: str, wire_of: Callable[[str], bytes], allowed: frozenset[str], rpc: str | None = None, gw: str = ""
    ) -> None:
        """One case on a gateway and RPC picked at random (or ``gw``, ``rpc``)."""
        r = rid(kind)
        gw = gw or rng.choice(gws)
        rpc = rpc or rng.choice(("bidi", "stream"))
        msg = Msg(kind, wire_of(r), allowed, r)
        if rpc == "bidi":
            bidi[gw].append([msg])
        else:
            streams.append(Call("stream", gw, [msg]))

    for i, (prompt, params, spec) in enumerate(hypothesis_params(N_PARAM_CASES)):
        ok = params_valid(prompt, params, spec)
        add(
            "params_valid" if ok else "params_invalid",
            lambda r, p=prompt, q=params, s=spec: start_msg(r, p, q, spec=s),
            allow(OK if ok else IA),
            "bidi" if i % 2 else "stream",
        )
    for prompt in [text_prompt(""), ids_prompt([]), None] * 10:
        add("empty_prompt", lambda r, p=prompt: start_msg(r, p, SMALL), allow(IA))
    for _ in range(30):
        n = rng.randint(MAX_MODEL_LEN, 4 * MAX_MODEL_LEN)
        add(
            "long_prompt_ids",
            lambda r, n=n: start_msg(r, ids_prompt([rng.randrange(VOCAB_SIZE)] * n), SMALL),
            allow(IA),
        )
    for _ in range(20):
        text = "x = 1\n" * rng.randint(MAX_MODEL_LEN, 3 * MAX_MODEL_LEN)
        add("long_prompt_text", lambda r, t=text: start_msg(r, text_prompt(t), SMALL), allow(IA))
    for gw in gws:  # megabytes of text, on each worker (defect 6: tokenized on the engine thread)
        for rpc, size in (("bidi", 1 << 20), ("stream", 3_900_000)):
            add("huge_prompt_text", lambda r, s=size: start_msg(r, text_prompt("a" * s), SMALL), allow(IA), rpc, gw)
    for rpc in ("bidi", "stream"):  # past a worker's 4 MiB message limit (defect 8)
        add("oversize_message", lambda r: start_msg(r, text_prompt("b" * 5_000_000), SMALL), allow(IA), rpc)
    for _ in range(60):
        bad = rng.choice([VOCAB_SIZE, VOCAB_SIZE + 1, 2**31, 2**32 - 1, rng.randrange(VOCAB_SIZE, 2**32)])
        ids = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(0, 10))]
        ids.insert(rng.randint(0, len(ids)), bad)
        add("token_id_out_of_range", lambda r, ids=ids: start_msg(r, ids_prompt(ids), SMALL), allow(IA))
    for _ in range(40):  # uint32 on the wire: a negative varint is what a careless client sends
        ids = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 10))] + [-rng.randint(1, 2**40)]
        prompt = field_bytes(2, b"".join(field_varint(1, t) for t in ids))
        params = pb.SamplingParams(**SMALL).SerializeToString()
        add("token_id_negative", lambda r, p=prompt, q=params: raw_start(r, p, q), allow(IA))
    for _ in range(30):
        add("max_tokens_zero", lambda r: start_msg(r, short_prompt(rng), {"max_tokens": 0}), allow(IA))
    for _ in range(30):  # huge: prompt + max_tokens past the context is refused, naming both
        n = rng.choice([MAX_MODEL_LEN, 10**6, 2**32 - 1])
        wire = start_msg("", short_prompt(rng), {"max_tokens": n, "temperature": 0.0, "ignore_eos": True})
        streams.append(Call("stream", rng.choice(gws), [Msg("max_tokens_huge", wire, allow(IA))], timeout=5.0))
    for _ in range(30):
        params = pb.SamplingParams(temperature=0.0, ignore_eos=True).SerializeToString()
        params += field_varint(5, -rng.randint(1, 2**40))
        prompt = pb.Prompt(text=rng.choice(BASES)).SerializeToString()
        msg = Msg("max_tokens_negative", raw_start("", prompt, params), allow(OK, DE, IA, RST_STREAM))
        streams.append(Call("stream", rng.choice(gws), [msg], timeout=0.3))
    for t in [math.nan, math.inf, -math.inf, -1e-9, -1.0, -1e308] * 7:
        add("temperature_bad", lambda r, t=t: start_msg(r, short_prompt(rng), {"temperature": t}), allow(IA))
    for p in [0.0, -0.0, -0.1, 1.0000001, 2.0, math.nan, math.inf, -math.inf] * 5:
        add("top_p_bad", lambda r, p=p: start_msg(r, short_prompt(rng), {"top_p": p, "max_tokens": 2}), allow(IA))
    for _ in range(40):
        k = rng.choice([-2, -3, -100, -(2**31), rng.randint(-(2**31), -2)])
        add("top_k_negative", lambda r, k=k: start_msg(r, short_prompt(rng), {"top_k": k, "max_tokens": 2}), allow(IA))
    for _ in range(10):
        add("top_k_minus_one", lambda r: start_msg(r, short_prompt(rng), {"top_k": -1, "max_tokens": 2}), allow(OK))
    for _ in range(12):
        stops = ["".join(rng.choices("abcdefxyz_ ():", k=rng.randint(1, 10))) for _ in range(rng.randint(1000, 5000))]
        add(
            "many_stop_strings", lambda r, s=stops: start_msg(r, short_prompt(rng), {**SMALL, "stop": s}), allow(OK, IA)
        )
    for _ in range(6):
        stops = ["z" * rng.choice([1 << 16, 1 << 18, 1 << 20]) for _ in range(rng.randint(1, 3))]
        add(
            "huge_stop_strings", lambda r, s=stops: start_msg(r, short_prompt(rng), {**SMALL, "stop": s}), allow(OK, IA)
        )
    for _ in range(40):
        name = rng.choice(["gpt-4", "draftwise-target ", "DRAFTWISE-TARGET", "\u00e9\u00e8", "x" * rng.randint(1, 300)])
        add("unknown_model", lambda r, m=name: start_msg(r, short_prompt(rng), SMALL, model=m), allow(IA))
    for rpc in ("bidi", "stream"):  # error messages must not echo it whole (defect 8)
        add(
            "unknown_model_1mib",
            lambda r: start_msg(r, short_prompt(rng), SMALL, model="m" * (1 << 20)),
            allow(IA),
            rpc,
        )
    for _ in range(120):
        wire = start_msg("", short_prompt(rng), {"max_tokens": 8, "temperature": 0.0})
        streams.append(
            Call("stream", rng.choice(gws), [Msg("deadline_1ms", wire, allow(DE, RST_STREAM))], timeout=0.001)
        )
    for _ in range(150):  # the add of such a request races its cancellation on the worker (defect 2)
        wire = start_msg("", short_prompt(rng), {"max_tokens": 16, "temperature": rng.choice([0.0, 1.0])})
        timeout = rng.uniform(0.002, 0.05)
        streams.append(
            Call("stream", rng.choice(gws), [Msg("deadline_short", wire, allow(OK, DE, RST_STREAM))], timeout=timeout)
        )
    calls.extend(streams)

    # multiplexed-stream-only cases, mixed into the batches of the cases above
    for _ in range(30):
        r = rid("duplicate_id")
        first = Msg(
            "duplicate_id",
            start_msg(r, short_prompt(rng), {"max_tokens": 48, "ignore_eos": True}),
            allow(),
            r,
            "ignore",
        )
        dup = Msg("duplicate_id", start_msg(r, short_prompt(rng), SMALL), allow(f"{IA}+{OK}"), r)
        bidi[rng.choice(gws)].append([first, dup])
    for _ in range(50):
        r = rid("cancel_unknown")
        cancel = gspb.GenerateRequest(cancel=pb.CancelGeneration(request_id=r)).SerializeToString()
        bidi[rng.choice(gws)].append([Msg("cancel_unknown", cancel, allow(NO_EVENT), r, "none")])
    for _ in range(30):  # a start and its cancel right behind it
        r = rid("cancel_known")
        cancel = gspb.GenerateRequest(cancel=pb.CancelGeneration(request_id=r)).SerializeToString()
        start = start_msg(r, short_prompt(rng), {"max_tokens": 32})
        group = [Msg("cancel_known", start, allow(ABORT, OK), r), Msg("cancel_known", cancel, allow(), r, "ignore")]
        bidi[rng.choice(gws)].append(group)
    for _ in range(50):
        bidi[rng.choice(gws)].append([Msg("no_oneof", b"", allow(IA), expect="anon")])
    for _ in range(20):
        empty = start_msg("", short_prompt(rng), SMALL)
        bidi[rng.choice(gws)].append([Msg("empty_request_id", empty, allow(IA), expect="anon")])
    for gw, groups in bidi.items():
        rng.shuffle(groups)
        batch: list[Msg] = []
        for group in groups:
            batch.extend(group)
            if len(batch) >= BIDI_BATCH or group is groups[-1]:
                calls.append(Call("bidi", gw, batch))
                batch = []

    # a greedy 64-token request next to a sampled 4-token one, speculating or not (defect 1)
    for i in range(16):
        msgs = []
        for j in range(3):
            spec = rng.choice(
                [None, {"enabled": True}, {"enabled": False}, {"max_speculative_tokens": rng.randint(1, 8)}]
            )
            g, s = rid("mixed_batch"), rid("mixed_batch")
            greedy = {"max_tokens": 64, "temperature": 0.0, "ignore_eos": rng.random() < 0.5}
            msgs.append(
                Msg(
                    "mixed_batch",
                    start_msg(g, text_prompt(BASES[(i + j) % len(BASES)]), greedy, spec=spec),
                    allow(OK),
                    g,
                )
            )
            sampled = {"max_tokens": 4, "temperature": 1.0}
            msgs.append(
                Msg(
                    "mixed_batch",
                    start_msg(s, text_prompt(BASES[(i + j + 1) % len(BASES)]), sampled, spec=spec),
                    allow(OK),
                    s,
                )
            )
        calls.append(Call("bidi", "spec" if i % 4 else "plain", msgs))

    # a whole Generate call under a 1 ms deadline (OK only if the server answered everything in time)
    for _ in range(20):
        msgs = [
            Msg(
                "deadline_1ms_stream_request",
                start_msg("a", short_prompt(rng), SMALL),
                allow(OK, DE, f"CALL_{DE}", f"CALL_{RST_STREAM}"),
                "a",
            )
        ]
        calls.append(
            Call(
                "bidi",
                rng.choice(gws),
                msgs,
                timeout=0.001,
                kind="deadline_1ms_stream",
                allowed=allow(DE, OK, RST_STREAM),
            )
        )

    # undecodable bytes: random, invalid UTF-8 in a string field, truncated messages (defect 5)
    for i in range(60):
        raw = undecodable(rng, i)
        gw = rng.choice(gws)
        if i % 2:
            calls.append(Call("stream", gw, [Msg("raw_bytes", raw, allow(IA))], timeout=RAW_TIMEOUT_S))
        else:
            msgs = [
                Msg("filler", start_msg("pre", short_prompt(rng), SMALL), allow(), "pre", "ignore"),
                Msg("filler", raw, allow(), expect="ignore"),
                Msg("filler", start_msg("post", short_prompt(rng), SMALL), allow(), "post", "ignore"),
            ]
            calls.append(Call("bidi", gw, msgs, timeout=RAW_TIMEOUT_S, kind="raw_bytes", allowed=allow(IA)))
    rng.shuffle(calls)
    return calls


def select_kinds(calls: list[Call], kinds: str) -> list[Call]:
    """Only the cases of the comma-separated ``kinds`` (all when empty): to look at one
    kind of case alone, e.g. ``DRAFTWISE_FUZZ_KINDS=mixed_batch,raw_bytes``."""
    wanted = {k.strip() for k in kinds.split(",") if k.strip()}
    if not wanted:
        return calls
    out = []
    for call in calls:
        msgs = [m for m in call.messages if m.kind in wanted or call.kind in wanted]
        if call.kind in wanted or any(m.expect != "ignore" for m in msgs):
            out.append(Call(call.rpc, call.gateway, msgs, call.timeout, call.kind, call.allowed))
    return out


def undecodable(rng: random.Random, i: int) -> bytes:
    """Bytes that do not parse as a GenerateRequest (nor as a GenerateStreamRequest)."""
    while True:
        choice = i % 3
        if choice == 0:
            raw = rng.randbytes(rng.randint(1, 64))
        elif choice == 1:  # a request id that is not UTF-8
            raw = field_bytes(1, field_bytes(1, b"\xff\xfe" + rng.randbytes(4)))
        else:  # a valid request cut short
            whole = start_msg("truncated", text_prompt(rng.choice(BASES)), SMALL)
            raw = whole[: rng.randint(1, len(whole) - 1)]
        try:
            gspb.GenerateRequest.FromString(raw)
        except Exception:  # DecodeError: what the suite wants
            return raw
        i += 1
