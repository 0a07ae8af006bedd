"""Per-request sampling parameters, with vLLM's names, defaults and validation.

Every invalid value raises ``ValueError`` whose message names the field and what it may
be, so that the gRPC layer can pass it straight back as INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from draftwise.worker.sampling.constraints import Constraint

MAX_LOGPROBS = 20
"""Most top-n log-probabilities a request may ask for per token."""
SPECULATIVE_METHOD_NAMES = ("draft", "eagle", "medusa", "ngram", "suffix")
"""What ``speculative_methods`` may name (the engine's speculative_method / speculative_lookup values)."""

GREEDY_TEMPERATURE_EPS = 1e-5
"""Temperatures below this are greedy (argmax), as in vLLM."""

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1  # what torch.Generator.manual_seed accepts


def _show(value: object) -> str:
    """repr of an offending value for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    """A finite real number (int, float, numpy scalar), not a bool, NaN or inf."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check_float(name: str, value: object, allowed: str, in_range: Callable[[float], bool]) -> float:
    """``value`` as a float, after checking it is a finite number and ``in_range``."""
    if not _is_finite_number(value):
        raise ValueError(f"{name} must be a finite number {allowed}, got {_show(value)}")
    v = float(value)  # type: ignore[arg-type]
    if not in_range(v):
        raise ValueError(f"{name} must be {allowed}, got {_show(value)}")
    return v


def _check_int(name: str, value: object, allowed: str, in_range: Callable[[int], bool]) -> int:
    """``value`` as an int, after checking it is an integer (not a bool) and ``in_range``."""
    if not _is_int(value) or not in_range(int(value)):  # type: ignore[call-overload]
        raise ValueError(f"{name} must be {allowed}, got {_show(value)}")
    return int(value)  # type: ignore[call-overload]


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {_show(value)}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request. Immutable; validated on construction."""

    n: int = 1
    """Completions per request; only 1 is supported (send n separate requests)."""
    temperature: float = 1.0
    """Softmax temperature, >= 0; below 1e-5 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest most-likely set whose mass reaches top_p, in (0, 1]."""
    top_k: int = 0
    """Keep the top_k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Keep tokens with probability >= min_p * the largest probability, in [0, 1]; 0 disables."""
    max_tokens: int | None = 16
    """Most tokens to generate, >= 1; None means up to the model's context."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens have been generated."""
    stop: str | Sequence[str] | None = None
    """Stop strings; normalised to a tuple of non-empty str (None -> (), "x" -> ("x",))."""
    stop_token_ids: Sequence[int] = ()
    """Token ids that end generation (the token is kept in the output); normalised to a tuple."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    seed: int | None = None
    """Keys this request's random numbers with each token's position (the same seed gives the same tokens whatever the batch, speculation or worker); None draws a fresh random seed."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of a token in the output, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """> 0; logits of tokens in prompt or output are divided (if > 0) or multiplied (if <= 0) by it."""
    logprobs: int | None = None
    """Return the sampled token's log-probability plus the top-n, n in [0, MAX_LOGPROBS]; None: none."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    use_speculation: bool = True
    """Let the engine speculate for this request when it has a proposer (False: plain decoding)."""
    max_speculative_tokens: int | None = None
    """Cap on the tokens drafted per step for this request, >= 1; None: the engine's num_speculative_tokens."""
    speculative_methods: tuple[str, ...] | None = None
    """The proposers this request may draft with, by name ("draft", "eagle", "medusa", "ngram", "suffix": the
    names of ``speculative_method`` / ``speculative_lookup``); None: every one the engine runs. A hybrid (say
    draft+suffix) drafts with the named parts only; a name the engine does not run is left out, and with none
    left the request decodes plainly (as ``use_speculation=True`` on an engine without a proposer)."""
    constraint: Constraint | None = None
    """What the output must match (a JSON schema, any JSON object, a regex, a grammar, a choice); None: free text.
    A dict in :meth:`Constraint.to_dict` form is accepted. Not with ignore_eos or min_tokens > 0 (the
    constraint decides where the output ends)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values are stored through this

        set_(self, "n", _check_int("n", self.n, "an integer >= 1", lambda v: v >= 1))
        if self.n > 1:
            raise ValueError("n > 1 is not supported yet; send n separate requests")

        set_(self, "temperature", _check_float("temperature", self.temperature, ">= 0", lambda v: v >= 0))
        set_(self, "top_p", _check_float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1))
        set_(self, "top_k", _check_int("top_k", self.top_k, "-1, 0 (disabled) or >= 1", lambda v: v >= -1))
        set_(self, "min_p", _check_float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1))

        if self.max_tokens is not None:
            set_(self, "max_tokens", _check_int("max_tokens", self.max_tokens, ">= 1 (or None)", lambda v: v >= 1))
        max_tokens = self.max_tokens
        set_(
            self,
            "min_tokens",
            _check_int(
                "min_tokens",
                self.min_tokens,
                f">= 0 and <= max_tokens ({max_tokens})",
                lambda v: v >= 0 and (max_tokens is None or v <= max_tokens),
            ),
        )

        set_(self, "stop", _normalise_stop(self.stop))
        set_(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))

        if self.seed is not None:
            seed_range = "an integer in [-2**63, 2**64 - 1] (or None)"
            set_(self, "seed", _check_int("seed", self.seed, seed_range, lambda v: _SEED_MIN <= v <= _SEED_MAX))

        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, _check_float(name, getattr(self, name), "in [-2, 2]", lambda v: -2 <= v <= 2))
        rep = _check_float("repetition_penalty", self.repetition_penalty, "> 0", lambda v: v > 0)
        set_(self, "repetition_penalty", rep)

        if self.logprobs is not None:
            logprobs_range = f"in [0, {MAX_LOGPROBS}] (or None)"
            set_(
                self,
                "logprobs",
                _check_int("logprobs", self.logprobs, logprobs_range, lambda v: 0 <= v <= MAX_LOGPROBS),
            )

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "use_speculation"):
            _check_bool(name, getattr(self, name))
        if self.max_speculative_tokens is not None:
            set_(
                self,
                "max_speculative_tokens",
                _check_int("max_speculative_tokens", self.max_speculative_tokens, ">= 1 (or None)", lambda v: v >= 1),
            )

        if self.speculative_methods is not None:
            set_(self, "speculative_methods", _check_methods(self.speculative_methods))

        if self.constraint is not None:
            set_(self, "constraint", Constraint.from_any(self.constraint))
            if self.ignore_eos:
                raise ValueError(
                    "ignore_eos cannot be combined with a constraint: the constraint decides where the output ends"
                )
            if self.min_tokens:
                raise ValueError(
                    "min_tokens cannot be combined with a constraint: the constraint decides where the output ends"
                )

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (tuples as lists)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Constraint):
                v = v.to_dict()
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Inverse of :meth:`to_dict`; absent keys take their defaults, unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**data)


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple):
        raise ValueError(f"stop must be a string, a list of strings or None, got {_show(stop)}")
    for s in items:
        if not isinstance(s, str):
            raise ValueError(f"stop strings must be str, got {_show(s)}")
        if not s:
            raise ValueError("stop strings must be non-empty, got ''")
    return tuple(items)


def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list | tuple):
        raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {_show(ids)}")
    for t in ids:
        if not _is_int(t) or t < 0:
            raise ValueError(f"stop_token_ids must be non-negative ints, got {_show(t)}")
    return tuple(int(t) for t in ids)


def _check_methods(value: object) -> tuple[str, ...]:
    """``speculative_methods`` as a tuple of distinct known names, in the given order."""
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ValueError(
            f"speculative_methods must be a non-empty list of {', '.join(SPECULATIVE_METHOD_NAMES)} (or None), "
            f"got {value!r}"
        )
    out: list[str] = []
    for name in value:
        if name not in SPECULATIVE_METHOD_NAMES:
            raise ValueError(
                f"speculative_methods: unknown method {name!r}; known: {', '.join(SPECULATIVE_METHOD_NAMES)}"
            )
        if name not in out:
            out.append(name)
    return tuple(out)
