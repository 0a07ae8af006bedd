"""Constrained decoding: a request's :class:`~draftwise.worker.sampling.constraints.Constraint`
compiled with xgrammar, and per step a token bitmask for each of its logits rows.

- **Compiling** (:class:`GrammarCompiler`): once per distinct constraint, cached (LRU) across
  requests; thread-safe, so the AsyncEngine compiles off the engine thread before the request is
  queued and the engine finds it cached. A constraint that cannot be used is a ValueError naming
  the problem: a schema that is not a valid JSON Schema, a keyword xgrammar would not enforce
  (:data:`UNSUPPORTED_KEYWORDS`), a regex or grammar that does not parse, a constraint that
  matches nothing.
- **Masking** (:class:`Grammars`): each constrained request keeps an xgrammar matcher over its
  output tokens. A plain row gets the mask of the request's output so far. A verify window
  ``[last, d1..dk]`` gets, at row ``j``, the mask of the output followed by ``d1..dj``: the matcher
  advances over the drafts while the grammar allows them, fills each row, then rolls back. A
  draft the grammar refuses ends the draft there: its row's mask gives it probability 0, so the
  verifier rejects it whatever the proposer (greedy, Gumbel-coupled and rejection-sampled rows
  alike, with or without a draft distribution q) and the token there is drawn from the masked
  target; the rows after it are never reached and are left unmasked. The output is therefore
  distributed as the masked target's, and greedy output with speculation equals greedy output
  without it.
- **Advancing**: once the output processor has kept a step's tokens, the matcher accepts them
  (:meth:`Grammars.accept`); the grammar is complete when the matcher has accepted a stop token
  (the model's end-of-sequence ids and the request's stop token ids, which the mask allows only
  where the constraint may end).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from draftwise.worker.sampling.constraints import Constraint

if TYPE_CHECKING:
    from draftwise.worker.sampling.sampling_params import SamplingParams

UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "patternProperties",
        "propertyNames",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "maxProperties",
        "$dynamicRef",
        "$recursiveRef",
    }
)
"""JSON Schema keywords xgrammar does not enforce: refused rather than silently ignored. ``allOf``
is accepted with one subschema only; ``oneOf`` is enforced as ``anyOf`` (its branches must not
overlap, as a discriminated union's do not)."""

_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keyword -> {name: subschema}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keyword -> [subschema]
_SCHEMA_ONES = ("items", "additionalProperties")  # keyword -> subschema
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")  # "[14:04:39] /project/cpp/x.cc:94: "

MAX_CACHED_GRAMMARS = 512
"""Compiled constraints kept (least recently used dropped first)."""


def check_schema(schema: Any) -> None:
    """ValueError if ``schema`` is not a valid JSON Schema or uses a keyword xgrammar would not enforce."""

    try:
        _check(schema)
    except RecursionError:
        raise ValueError("the JSON schema is nested too deeply") from None


def _check(schema: Any) -> None:
    import jsonschema
    from jsonschema.validators import validator_for

    try:
        validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the root"
        raise ValueError(f"the JSON schema is invalid at {where}: {e.message}") from None
    _check_keywords(schema, "")


def _check_keywords(node: Any, path: str) -> None:
    if not isinstance(node, dict):
        return
    for key in node:
        if key in UNSUPPORTED_KEYWORDS:
            raise ValueError(f"JSON schema keyword {key!r} (at {path or '/'}) is not supported in constraints")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise ValueError(
            f"JSON schema keyword 'allOf' with more than one subschema (at {path or '/'}) is not supported"
        )
    for key in _SCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, s in sub.items():
                _check_keywords(s, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                _check_keywords(s, f"{path}/{key}/{i}")
    for key in _SCHEMA_ONES:
        _check_keywords(node.get(key), f"{path}/{key}")


def _choice_grammar(options: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``options``."""
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


def _clean(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _LOG_PREFIX.sub("", text)


@dataclass
class CompileStats:
    compiles: int = 0  # constraints compiled (cache misses)
    hits: int = 0  # served from the cache
    seconds: float = 0.0  # time spent compiling


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary, with a cache; thread-safe.

    ``tokenizer``: the Hugging Face tokenizer; ``vocab_size``: the model's (logits width, which may
    exceed the tokenizer's); ``stop_token_ids``: the model's end-of-sequence ids."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._lock = threading.Lock()
        self._compiler: Any = None  # built on first use: engines without constraints never pay for it
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self.stats = CompileStats()

    def _xgr(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of ``constraint`` (cached); ValueError naming what is wrong."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                self.stats.hits += 1
                return hit
            t0 = time.perf_counter()
            compiled = self._compile(constraint)
            _check_matches_something(compiled, constraint)
            self.stats.compiles += 1
            self.stats.seconds += time.perf_counter() - t0
            self._cache[constraint] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return compiled

    def _compile_json(self, schema: str, strict: bool) -> Any:
        return self._xgr().compile_grammar(_json_ebnf(schema, strict), root_rule_name="root")

    def _compile(self, c: Constraint) -> Any:
        compiler = self._xgr()
        try:
            if c.kind == "json_schema":
                check_schema(c.schema)
                assert isinstance(c.value, str)
                try:
                    return self._compile_json(c.value, strict=True)
                except RuntimeError:  # strict mode (no extra items or properties) can refuse a valid schema
                    return self._compile_json(c.value, strict=False)
            if c.kind == "json_object":
                return self._compile_json('{"type": "object"}', strict=False)
            if c.kind == "regex":
                return compiler.compile_regex(c.value)
            if c.kind == "grammar":
                return compiler.compile_grammar(c.value, root_rule_name="root")
            assert isinstance(c.value, tuple)
            return compiler.compile_grammar(_choice_grammar(c.value), root_rule_name="root")
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"the {c.kind} constraint cannot be compiled: {_clean(e)}") from None


def _json_ebnf(schema: str, strict: bool) -> str:
    """xgrammar's grammar for ``schema`` (compact JSON), with its string characters closed to what JSON
    and UTF-8 allow: xgrammar 0.2.9 admits raw U+0000-U+001F in length-bounded strings
    (mlc-ai/xgrammar#800) and the UTF-8 encoding of surrogates in every string, outputs that are not
    JSON or not UTF-8."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
    for hole, closed in _STRING_CLASSES:
        ebnf = ebnf.replace(hole, closed)
    return ebnf


_STRING_CLASSES = (
    (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\ud800-\udfff]"),
    (r"[^\0-\x1f\"\\\r\n]", r"[^\0-\x1f\"\\\r\n\ud800-\udfff]"),
)
"""xgrammar's string character classes (EBNF text) and what they become: no control characters, no surrogates."""


def _check_matches_something(compiled: Any, c: Constraint) -> None:
    """ValueError for a constraint no output can satisfy (no token allowed at the start, and the
    empty output not accepted either)."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    m.fill_next_token_bitmask(mask, 0)
    if not bool(mask.any()) and not m.is_completed():
        raise ValueError(f"the {c.kind} constraint can match nothing: no output satisfies it")


@dataclass(frozen=True)
class GrammarStats:
    """An engine's structured-output counters since it started (GetLoad reports them)."""

    requests: int = 0  # constrained requests added
    compile_seconds: float = 0.0  # time spent compiling constraints (cache misses)
    mask_seconds: float = 0.0  # time spent filling and applying masks (host), drafting included
    masked_steps: int = 0  # steps that masked at least one row


@dataclass
class _State:
    matcher: Any
    refused: int = 0  # drafted tokens the grammar refused


class Grammars:
    """The matchers of one engine's constrained requests, and the per-step masks."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler  # None: no tokenizer, no constraints
        self.states: dict[str, _State] = {}
        self.mask_seconds = 0.0  # time spent filling and applying masks (host)
        self.masked_rows = 0
        self.masked_steps = 0
        self.num_requests = 0  # constrained requests added

    def add(self, request_id: str, params: SamplingParams, output: Sequence[int], earlier: Any = None) -> None:
        """Start ``request_id``'s matcher for ``params.constraint`` (its stop tokens: the model's and
        ``params.stop_token_ids``); ``output``: tokens it already has (a continuation), which must satisfy
        the constraint so far (ValueError otherwise); ``earlier``: a continuation's ``SpecStats`` (the
        drafts its grammar refused before) or None. Touches nothing on error."""
        import xgrammar as xgr

        if self.compiler is None:
            raise ValueError("constraints need a tokenizer (the engine runs with skip_tokenizer_init)")
        constraint = params.constraint
        assert constraint is not None
        compiled = self.compiler.compile(constraint)
        stops = sorted(set(self.compiler.stop_token_ids) | set(params.stop_token_ids))
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        for i, t in enumerate(output):
            if matcher.is_terminated() or not matcher.accept_token(int(t)):
                raise ValueError(
                    f"the continuation's token {i} ({t}) does not satisfy the {constraint.kind} constraint"
                )
        self.states[request_id] = _State(matcher, getattr(earlier, "grammar_refused", 0))
        self.num_requests += 1

    @property
    def stats(self) -> GrammarStats:
        compile_s = 0.0 if self.compiler is None else self.compiler.stats.seconds
        return GrammarStats(self.num_requests, compile_s, self.mask_seconds, self.masked_steps)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def refused(self, request_id: str) -> int:
        st = self.states.get(request_id)
        return 0 if st is None else st.refused

    def is_complete(self, request_id: str) -> bool:
        """The constraint has accepted a stop token (or needs nothing more): the output is whole."""
        st = self.states.get(request_id)
        return st is None or bool(st.matcher.is_terminated())

    def accept(self, request_id: str, tokens: Sequence[int]) -> None:
        """The tokens a step kept for ``request_id`` (after the output processor); each was allowed by
        the mask it was drawn under, so a refusal here is a broken invariant (RuntimeError)."""
        st = self.states.get(request_id)
        if st is None:
            return
        for t in tokens:
            if st.matcher.is_terminated():
                raise RuntimeError(f"token {t} kept after the constraint was complete")
            if not st.matcher.accept_token(int(t)):
                raise RuntimeError(f"token {t} was kept but the constraint does not allow it")

    def fill(
        self,
        request_id: str,
        drafts: Sequence[int],
        mask: torch.Tensor,  # [rows, words] int32, CPU
        first_row: int,
    ) -> None:
        """Fill ``mask`` rows ``first_row .. first_row + len(drafts)`` for ``request_id``: the mask of its
        output, then of its output followed by each draft the grammar allows; the rows after a refused
        draft, or after a stop token, keep what they hold (all allowed: never read). Counts the refused drafts."""
        st = self.states[request_id]
        m = st.matcher
        m.fill_next_token_bitmask(mask, first_row)
        words = mask.numpy()  # a view: reads the rows as they are filled, without a tensor index per draft
        taken = 0
        for j, d in enumerate(drafts):
            word = int(words[first_row + j, d >> 5])
            if not (word >> (d & 31)) & 1 or not m.accept_token(int(d)):
                st.refused += len(drafts) - j
                break
            taken += 1
            if m.is_terminated():  # a stop token: the output ends there, the rows after it are never read
                break
            m.fill_next_token_bitmask(mask, first_row + j + 1)
        if taken:
            m.rollback(taken)

    def mask_draft(self, request_ids: Sequence[str], drafts: Sequence[Sequence[int]], logits: torch.Tensor) -> None:
        """Drafting under the grammar (a draft model's proposals): row ``i`` of ``logits``, the draft's
        next-token logits for ``request_ids[i]`` after its output and ``drafts[i]``, keeps only what the
        request's grammar allows there, so that the draft proposes what the target may accept. Its q is
        then the masked draft distribution, which the drafts are drawn from: verification stays exact."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self.states]
        if not rows:
            return
        t0 = time.perf_counter()
        assert self.compiler is not None
        mask = self.new_mask(logits.shape[0], self.compiler.vocab_size)
        used = []
        for i in rows:
            m = self.states[request_ids[i]].matcher
            taken = 0
            for t in drafts[i]:
                if m.is_terminated() or not m.accept_token(int(t)):
                    break
                taken += 1
            if taken == len(drafts[i]) and not m.is_terminated():  # else: past a stop token, never read
                m.fill_next_token_bitmask(mask, i)
                used.append(i)
            if taken:
                m.rollback(taken)
        self.apply(logits, mask, used)
        self.mask_seconds += time.perf_counter() - t0

    def apply(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        """Disallowed tokens of ``rows`` of ``logits`` to -inf, in place."""
        import xgrammar as xgr

        if not rows or self.compiler is None:
            return
        m = mask.to(logits.device, non_blocking=True) if mask.device != logits.device else mask
        if logits.dtype == torch.float32 or logits.device.type == "cuda":
            vocab = min(logits.shape[1], self.compiler.vocab_size)  # a draft's logits may be narrower
            xgr.apply_token_bitmask_inplace(logits, m, vocab_size=vocab, indices=rows)
            return
        allowed = _unpack(m[rows], logits.shape[1])  # other dtypes on the CPU: torch ops
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))

    @staticmethod
    def new_mask(num_rows: int, vocab_size: int) -> torch.Tensor:
        """A bitmask of ``num_rows`` rows, every token allowed."""
        return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _unpack(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab] bool."""
    bits = torch.arange(32, device=mask.device, dtype=torch.int32)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool()
    return allowed.reshape(mask.shape[0], -1)[:, :vocab_size]


__all__ = ["UNSUPPORTED_KEYWORDS", "GrammarCompiler", "GrammarStats", "Grammars", "check_schema"]
