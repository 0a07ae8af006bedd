"""Incremental detokenization for streaming: token ids in, text deltas out, stop strings applied.

Each new token is decoded inside a small window of recent tokens (vLLM's prefix offset / read offset
technique): ``decode(ids[prefix_offset:])`` minus ``decode(ids[prefix_offset:read_offset])`` is the new
text, so a step costs a few tokens of decoding however long the output is, and a token's leading space
or merge with its neighbour comes out as the full decode would write it. The window starts on the
prompt's last few tokens.

Text is held back at two levels:

- tokens whose decode ends in U+FFFD (an incomplete UTF-8 character, e.g. one byte token of a
  Chinese character) stay unread until the character completes;
- complete text that could be the start of a stop string stays unreleased until the stop string
  matches (generation ends, the stop string is cut) or cannot match any more (the text is released).

``flush()`` releases both when generation ends for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, so that it reads in context.
_CONTEXT_TOKENS = 6
# Unread tokens after which a run that still ends in U+FFFD is taken as bytes that are not UTF-8
# and released (a character has at most 4 bytes, so at most 4 tokens): keeps a step's work bounded.
_MAX_UNREAD_TOKENS = 8
# An incomplete UTF-8 character has at most 3 bytes, so it lies within the last 3 tokens.
_MAX_INCOMPLETE_TOKENS = 3


@dataclass(frozen=True)
class DetokenizerDelta:
    """What one ``add_tokens`` call released."""

    text: str  # newly released text (may be "")
    stop_matched: str | None  # the stop string that ended generation, or None


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, applying its stop strings.

    ``tokenizer`` is a Hugging Face tokenizer or ``draftwise.worker.text.tokenizer.Tokenizer`` (its ``.hf``
    is used). A stop string ends generation at its earliest occurrence in the text (at equal starts,
    the shorter one, which completes first); the stop string is left out of the output unless
    ``include_stop_str_in_output``, and text after it is always dropped, as are the tokens after the
    one that completed it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r} in stop")
        self._tokenizer = getattr(tokenizer, "hf", tokenizer)
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop_str_in_output
        self._skip_special_tokens = skip_special_tokens

        context = self._context(list(prompt_token_ids))
        self._ids: list[int] = context  # context tokens, then output tokens
        self._num_context = len(context)
        self._prefix_offset = 0  # window start: tokens before it are never decoded again
        self._read_offset = len(context)  # tokens before it have had their text read
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self._held = ""  # complete text held back as a possible start of a stop string
        self._parts: list[str] = []  # released text
        self._stop_matched: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text released so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens taken in (none after the one that completed a stop string)."""
        return self._ids[self._num_context :]

    @property
    def stop_matched(self) -> str | None:
        """The stop string that ended generation, or None."""
        return self._stop_matched

    @property
    def finished(self) -> bool:
        """True after a stop string matched or ``flush()`` was called."""
        return self._finished

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Takes in one or more new output tokens; returns the text they release."""
        if self._finished:
            raise RuntimeError("add_tokens after generation ended (a stop string matched or flush() was called)")
        released: list[str] = []
        for token_id in token_ids:
            self._ids.append(int(token_id))
            text = self._read()
            if text:
                released.append(self._release(text))
                if self._stop_matched is not None:
                    self._finished = True
                    break
        return DetokenizerDelta("".join(released), self._stop_matched)

    def prime(self, token_ids: Sequence[int]) -> str | None:
        """Takes in output tokens that were produced (and their text sent) before, one at a time as
        generation would, discarding the text they release: the state (window, held-back text) is
        then the one the original run had, so later text continues its output exactly. Returns the
        stop string that matched among them, or None."""
        for token_id in token_ids:
            if self.add_tokens([token_id]).stop_matched is not None:
                break
        return self._stop_matched

    def flush(self) -> str:
        """Generation ended for another reason: releases all held-back text, a trailing incomplete
        character as the tokenizer decodes it (a stop string in it still cuts it). Later calls give ""."""
        if self._finished:
            return ""
        self._finished = True
        tail = ""
        if self._read_offset < len(self._ids):
            tail = self._advance(len(self._ids), self._decode(self._ids[self._prefix_offset :]))
        text = self._release(tail)
        if self._stop_matched is None:
            text += self._held
            self._parts.append(self._held)
            self._held = ""
        return text

    # -- token level: window decoding ------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last tokens, starting and ending on whole characters (else fewer, or none)."""
        context = prompt_ids[-_CONTEXT_TOKENS:]
        while context and self._decode(context).startswith(REPLACEMENT_CHAR):
            context = context[1:]
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            return []  # the prompt ends inside a character: the output is decoded on its own
        return context

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _read(self) -> str:
        """Text completed by the unread tokens: "" while their decode ends in an incomplete character."""
        ids = self._ids
        prefix_text = self._window_prefix_text()
        new_text = self._decode(ids[self._prefix_offset :])
        incomplete = new_text.endswith(REPLACEMENT_CHAR)
        if not incomplete and len(new_text) > len(prefix_text):
            return self._advance(len(ids), new_text)
        if len(ids) - self._read_offset < _MAX_UNREAD_TOKENS:
            return ""
        # A long unread run: tokens that decode to nothing, or bytes that are not UTF-8. Release it,
        # keeping back the last tokens where they may still start a character.
        if incomplete:
            cut = len(ids) - _MAX_INCOMPLETE_TOKENS
            cut_text = self._decode(ids[self._prefix_offset : cut])
            if len(cut_text) > len(prefix_text) and new_text.startswith(cut_text):
                return self._advance(cut, cut_text)
        return self._advance(len(ids), new_text)

    def _advance(self, end: int, window_text: str) -> str:
        """Reads tokens up to ``end`` (``window_text`` is their window decode); returns their text."""
        prefix_text = self._window_prefix_text()
        if window_text.startswith(prefix_text):
            text = window_text[len(prefix_text) :]
        else:  # the new tokens changed how the window's start decodes: take their text on its own
            text = self._decode(self._ids[self._read_offset : end])
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_text = None
        return text

    # -- text level: stop strings ----------------------------------------------------------------

    def _release(self, text: str) -> str:
        """Runs newly read text through the stop strings; returns the part that can be shown now."""
        buf = self._held + text
        match = self._find_stop(buf)
        if match is not None:
            start, stop = match
            out = buf[: start + len(stop)] if self._include_stop else buf[:start]
            self._held = ""
            self._stop_matched = stop
        else:
            keep = self._stop_prefix_len(buf)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self._parts.append(out)
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in ``text`` (the shorter one at equal starts), as (start, stop)."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0 and (best is None or (start, len(stop)) < (best[0], len(best[1]))):
                best = (start, stop)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of ``text`` that is the start of a stop string (0 if none)."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
