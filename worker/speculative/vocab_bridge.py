"""Drafting across tokenizers: how a draft model whose tokenizer differs from the target's maps
its tokens to the target's and back (docs/engine.md, "Drafts with another tokenizer").

Every token of each tokenizer stands for a string of bytes, its *surface* (byte-level BPE
pieces mapped back to bytes, SentencePiece's ``▁`` and ``<0xNN>`` pieces decoded, added and
special tokens their content). Tokens of the two vocabularies with the same surface form the
**intersection**, a one-to-one map between draft and target ids. Two ways to draft with it,
chosen by how much of the draft's vocabulary it covers (:func:`build_bridge`; the worker logs
the figures at load):

- **TLI** (token-level intersection, Timor et al., ICML 2025): the draft's distribution is
  restricted to the intersection and moved onto the target's ids, so each drafted token is a
  target token with a draft probability, and exact rejection sampling, Gumbel coupling and
  greedy matching apply unchanged.
- **SLEM** (string-level exact match): the draft writes text in its own tokens, greedily; the
  text is tokenized again by the target's tokenizer and its tokens are proposed as lookup
  drafts are (q one-hot at each: the verifier keeps a draft with the target's probability of
  it, so the output is still exactly the target's).

Either way the draft reads the request's tokens in its own tokenization: the tokens a request
has when the draft first meets it as one text (the draft's tokenizer encodes it), each later
token on its own (its surface split into the longest draft tokens, a shared token being its
own counterpart), so that rolling back to any later position is a cut in both sequences.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import structlog
import torch

from draftwise.worker.text.tokenizer import Tokenizer

__all__ = ["MIN_TLI_OVERLAP", "VocabBridge", "build_bridge", "token_surfaces"]

log = structlog.get_logger("draftwise.spec")

MIN_TLI_OVERLAP = 0.5
"""TLI when at least this share of the draft's tokens are in the intersection; SLEM below."""

Mode = Literal["tli", "slem"]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte is written as -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()


def _byte_level(piece: str) -> bytes | None:
    try:
        return bytes(_BYTE_DECODER[c] for c in piece)
    except KeyError:
        return None


def _sentencepiece(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def token_surfaces(tok: Tokenizer) -> list[bytes | None]:
    """The bytes each id of ``tok`` stands for (None: nothing, e.g. an id with no piece)."""
    hf = tok.hf
    decoder = json.dumps(json.loads(hf.backend_tokenizer.to_str()).get("decoder"))
    pieces = hf.convert_ids_to_tokens(list(range(len(hf))))
    if "ByteLevel" in decoder:
        convert = _byte_level
    elif "ByteFallback" in decoder or "Metaspace" in decoder or "\u2581" in decoder:
        convert = _sentencepiece
    else:
        convert = str.encode
    out: list[bytes | None] = [None if p is None else convert(p) for p in pieces]
    for i, added in hf.added_tokens_decoder.items():
        if i < len(out):
            out[i] = added.content.encode()
    return [s if s else None for s in out]


@dataclass
class VocabBridge:
    """The two vocabularies' intersection and the translations between them."""

    draft_tok: Tokenizer
    target_tok: Tokenizer
    draft_surfaces: list[bytes | None]
    target_surfaces: list[bytes | None]
    draft_vocab: int  # rows of the draft's logits (its config's vocabulary, padding included)
    target_vocab: int
    mode: Mode = "tli"
    to_target: torch.Tensor = field(init=False)  # [draft_vocab] long: the target's id, -1 outside the intersection
    shared_draft_ids: torch.Tensor = field(init=False)  # the draft ids in the intersection
    to_draft: dict[int, int] = field(init=False)  # target id -> draft id, in the intersection
    _pieces: dict[bytes, int] = field(init=False)  # draft surface -> id (ordinary tokens, for splitting)
    _longest: int = field(init=False)
    _target_pieces: dict[bytes, int] = field(init=False)  # the same for the target's ordinary tokens
    _target_longest: int = field(init=False)
    _cache: dict[int, list[int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        by_surface: dict[bytes, int] = {}
        for i, s in enumerate(self.target_surfaces[: self.target_vocab]):
            if s is not None:
                by_surface.setdefault(s, i)
        self.to_target = torch.full((self.draft_vocab,), -1, dtype=torch.long)
        self.to_draft = {}
        specials = set(self.draft_tok.hf.added_tokens_decoder)
        self._pieces = {}
        for i, s in enumerate(self.draft_surfaces[: self.draft_vocab]):
            if s is None:
                continue
            if i not in specials:
                self._pieces.setdefault(s, i)
            t = by_surface.get(s)
            if t is not None and t not in self.to_draft:
                self.to_target[i] = t
                self.to_draft[t] = i
        self.shared_draft_ids = (self.to_target >= 0).nonzero().flatten()
        self._longest = max((len(s) for s in self._pieces), default=1)
        target_specials = set(self.target_tok.hf.added_tokens_decoder)
        self._target_pieces = {}
        for i, s in enumerate(self.target_surfaces[: self.target_vocab]):
            if s is not None and i not in target_specials:
                self._target_pieces.setdefault(s, i)
        self._target_longest = max((len(s) for s in self._target_pieces), default=1)

    @property
    def shared(self) -> int:
        """Tokens in the intersection."""
        return len(self.to_draft)

    @property
    def overlap(self) -> float:
        """The share of the draft's tokens (those standing for something) in the intersection."""
        return self.shared / max(1, sum(s is not None for s in self.draft_surfaces[: self.draft_vocab]))

    # ------------------------------------------------------------------ target -> draft

    def split(self, data: bytes) -> list[int]:
        """``data`` as the longest draft tokens from the left (bytes no token stands for are skipped)."""
        return _split(data, self._pieces, self._longest)

    def translate(self, t: int) -> list[int]:
        """The draft's tokens for one target token: its counterpart when shared, else its
        surface split into draft tokens (nothing for an id that stands for nothing)."""
        got = self._cache.get(t)
        if got is None:
            d = self.to_draft.get(t)
            if d is not None:
                got = [d]
            else:
                s = self.target_surfaces[t] if t < len(self.target_surfaces) else None
                got = [] if s is None else self.split(s)
            self._cache[t] = got
        return got

    def translate_text(self, ids: list[int]) -> list[int]:
        """The draft's tokens for a run of target tokens read as one text (the draft's
        tokenizer encodes it, with its own leading special tokens; text that is not UTF-8, or
        that the draft's tokenizer cannot encode, e.g. a character outside a word-level
        vocabulary, is split instead)."""
        data = b"".join(s for t in ids if t < len(self.target_surfaces) and (s := self.target_surfaces[t]))
        lead = list(self.draft_tok.hf.encode("", add_special_tokens=True))  # e.g. the draft's BOS
        try:
            return lead + list(self.draft_tok.hf.encode(data.decode(), add_special_tokens=False))
        except Exception:  # noqa: BLE001 - UnicodeDecodeError, or the tokenizer's own (a Rust exception)
            return lead + self.split(data)

    # ------------------------------------------------------------------ draft -> target

    def retokenize(self, draft_ids: list[int], complete: bool) -> list[int]:
        """SLEM: the target's tokens for the text the draft wrote; unless ``complete`` (the draft
        ended its text), the last one is dropped, as the text may go on inside it."""
        data = b"".join(s for d in draft_ids if d < len(self.draft_surfaces) and (s := self.draft_surfaces[d]))
        try:
            text = data.decode(errors="ignore")
            ids = list(self.target_tok.hf.encode(text, add_special_tokens=False)) if text else []
        except Exception:  # noqa: BLE001 - text the target's tokenizer cannot encode (a Rust exception): split it
            ids = _split(data, self._target_pieces, self._target_longest)
        return ids if complete else ids[:-1]


def _split(data: bytes, pieces: dict[bytes, int], longest: int) -> list[int]:
    """``data`` as the longest of ``pieces`` from the left (bytes no piece stands for are skipped)."""
    out, i = [], 0
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            t = pieces.get(data[i : i + n])
            if t is not None:
                out.append(t)
                i += n
                break
        else:
            i += 1
    return out


def build_bridge(
    draft_tok: Tokenizer, target_tok: Tokenizer, draft_vocab: int, target_vocab: int, mode: str = "auto"
) -> VocabBridge | None:
    """The bridge between two tokenizers; None when the draft's ids mean what the target's do
    (the draft then drafts target ids directly). ``mode``: "tli", "slem", or "auto" (TLI when
    at least MIN_TLI_OVERLAP of the draft's tokens are shared)."""
    d, t = token_surfaces(draft_tok), token_surfaces(target_tok)
    if len(d) <= len(t) and draft_vocab <= target_vocab and all(s is None or s == t[i] for i, s in enumerate(d)):
        return None
    bridge = VocabBridge(draft_tok, target_tok, d, t, draft_vocab, target_vocab)
    if mode not in ("auto", "tli", "slem"):
        raise ValueError(f"speculative_vocab_mapping must be 'auto', 'tli' or 'slem', got {mode!r}")
    chosen: Mode = ("tli" if bridge.overlap >= MIN_TLI_OVERLAP else "slem") if mode == "auto" else mode  # type: ignore[assignment]
    if chosen == "tli" and bridge.shared == 0:
        raise ValueError("the draft and target vocabularies share no token: TLI cannot draft (use 'slem')")
    bridge.mode = chosen
    log.info(
        "draft with another tokenizer",
        mode=chosen,
        shared_tokens=bridge.shared,
        draft_tokens=len(d),
        target_tokens=len(t),
        overlap_of_draft=round(bridge.overlap, 4),
        overlap_of_target=round(bridge.shared / max(1, len(t)), 4),
    )
    return bridge
