"""The incremental detokenizer on real tokenizers: the project's byte-level BPE tokenizer and a
sentencepiece-style byte-fallback tokenizer built here, on Chinese text, emoji and indented code.

Deltas never split a character, join to the full decode, cost a bounded window of decoding per
token, and stop strings match across token and delta boundaries with the right text held back."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from draftwise.worker import default_model_path
from draftwise.worker.text.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from draftwise.worker.text.tokenizer import Tokenizer

FFFD = "\ufffd"

CHINESE = "今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据。"
EMOJI = "Family: 👨‍👩‍👧‍👦, flags 🇯🇵🇫🇷, thumbs 👍🏽 and ❤️ ok"
CODE = (
    "def area(r):\n"
    '    """Circle area, 圆的面积."""\n'
    "    if r < 0:\n"
    '        raise ValueError("负数")\n'
    "    x = 1\n\ny = 2\n"
    "    return 3.14159 * r * r\n"
)
TEXTS = {"chinese": CHINESE, "emoji": EMOJI, "code": CODE, "mixed": CODE + EMOJI + "\n" + CHINESE}


# -- tokenizers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe() -> Any:
    """The project's byte-level BPE tokenizer (the shipped target model's).

    DRAFTWISE_TEST_TOKENIZER=<folder> points the tests at another copy of it, for when the default
    model folder is not there yet (e.g. while the model trains)."""
    folder = os.environ.get("DRAFTWISE_TEST_TOKENIZER") or str(default_model_path("target"))
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def byte_fallback() -> Any:
    """Sentencepiece-style byte fallback: ASCII characters, ``<0xNN>`` byte tokens for everything else."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [("d", "e"), ("de", "f"), (" ", " ")]
    for c in [chr(i) for i in range(32, 127)] + ["\n", "\t"] + [a + b for a, b in merges]:
        vocab[c] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def llama_style() -> Any:
    """Like Llama 2's tokenizer: "▁" for spaces, byte fallback, the decode's leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in [chr(i) for i in range(33, 127)] + ["▁", "▁w", "▁wo"]:
        vocab[c] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[("▁", "w"), ("▁w", "o")], unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(params=["bpe", "byte_fallback"])
def tok(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


class _Recording:
    """A tokenizer that records the length of every decode call."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)


# -- helpers ------------------------------------------------------------------------------------


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _groups(ids: list[int], grouping: str) -> list[list[int]]:
    """``"one"``: one token per call; ``"random:SEED"``: groups of 1 to 6 tokens."""
    if grouping == "one":
        return [[i] for i in ids]
    rng = random.Random(int(grouping.removeprefix("random:")))
    out: list[list[int]] = []
    pos = 0
    while pos < len(ids):
        n = rng.randint(1, 6)
        out.append(ids[pos : pos + n])
        pos += n
    return out


def _stream(
    tok: Any, prompt: str, output_ids: list[int], grouping: str = "one", **kwargs: Any
) -> tuple[IncrementalDetokenizer, list[DetokenizerDelta]]:
    """Feeds the output tokens (until a stop string matches); checks no delta holds a U+FFFD."""
    detok = IncrementalDetokenizer(tok, _encode(tok, prompt), **kwargs)
    deltas: list[DetokenizerDelta] = []
    for group in _groups(output_ids, grouping):
        delta = detok.add_tokens(group)
        deltas.append(delta)
        assert FFFD not in delta.text, (delta, deltas)
        assert detok.output_text == "".join(d.text for d in deltas)
        if delta.stop_matched is not None:
            break
    return detok, deltas


def _completing_token(tok: Any, ids: list[int], stop: str) -> int:
    """Index of the token whose decode first contains ``stop``."""
    return next(i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1]))


# -- characters, full decode, bounded work ------------------------------------------------------


@pytest.mark.parametrize("name", ["chinese", "emoji"])
def test_texts_split_characters_across_tokens(tok: Any, name: str) -> None:
    # Otherwise the U+FFFD checks below could not fail.
    ids = _encode(tok, TEXTS[name])
    assert any(FFFD in tok.decode([i]) for i in ids)
    assert tok.decode(ids) == TEXTS[name]


@pytest.mark.parametrize("grouping", ["one", "random:0", "random:1", "random:2"])
@pytest.mark.parametrize("name", list(TEXTS))
def test_deltas_join_to_full_decode(tok: Any, name: str, grouping: str) -> None:
    out = _encode(tok, TEXTS[name])
    detok, deltas = _stream(tok, "Prompt: ", out, grouping)
    full = tok.decode(out)
    for n in range(1, len(deltas) + 1):  # every release is final: a prefix of the full text
        assert full.startswith("".join(d.text for d in deltas[:n]))
    tail = detok.flush()
    assert tail == ""  # nothing was left incomplete
    assert "".join(d.text for d in deltas) == detok.output_text == full
    assert all(d.stop_matched is None for d in deltas)
    assert detok.output_token_ids == out


def test_character_is_held_until_its_last_byte(byte_fallback: Any) -> None:
    out = _encode(byte_fallback, "a中b")
    assert len(out) == 5  # a, three byte tokens, b
    detok = IncrementalDetokenizer(byte_fallback, [])
    assert [detok.add_tokens([i]).text for i in out] == ["a", "", "", "中", "b"]


def test_flag_emoji_comes_out_whole_codepoints(bpe: Any) -> None:
    out = _encode(bpe, "🇯🇵")
    detok = IncrementalDetokenizer(bpe, [])
    texts = [detok.add_tokens([i]).text for i in out]
    assert [t for t in texts if t] == ["🇯", "🇵"]  # each regional indicator once complete


def test_work_per_token_is_bounded(bpe: Any) -> None:
    out = _encode(bpe, (CODE + CHINESE + EMOJI) * 8)
    assert len(out) > 1000
    rec = _Recording(bpe)
    detok = IncrementalDetokenizer(rec, _encode(bpe, "Prompt: " * 20))
    text = "".join(detok.add_tokens([i]).text for i in out) + detok.flush()
    assert text == bpe.decode(out)
    assert max(rec.lengths) <= 16  # a window of recent tokens, never the whole output
    assert len(rec.lengths) <= 2 * len(out) + 4


@pytest.mark.parametrize("n_garbage", [*range(13), 40])
def test_bytes_that_are_not_utf8_do_not_grow_the_window(bpe: Any, n_garbage: int) -> None:
    # A model may emit stray continuation bytes: they decode as U+FFFD, and the window must not
    # keep growing behind them; a real character right after still comes out whole.
    byte_id = {b: bpe.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    out = _encode(bpe, "ok") + [byte_id[0x80]] * n_garbage + [byte_id[b] for b in "中".encode()]
    out += _encode(bpe, " done")
    rec = _Recording(bpe)
    detok = IncrementalDetokenizer(rec, [])
    texts = [detok.add_tokens([i]).text for i in out]
    assert "".join(texts) + detok.flush() == bpe.decode(out) == "ok" + FFFD * n_garbage + "中 done"
    assert max(rec.lengths) <= 16


def test_stray_byte_after_a_character(byte_fallback: Any) -> None:
    # Byte fallback decodes a whole run of byte tokens as U+FFFD when any of it is not UTF-8; 中 was
    # released before the stray byte came, so the stray byte alone becomes U+FFFD.
    ids = {t: byte_fallback.convert_tokens_to_ids(t) for t in ("<0x80>", "a")}
    out = _encode(byte_fallback, "中") + [ids["<0x80>"], ids["a"]]
    assert byte_fallback.decode(out) == FFFD * 4 + "a"
    detok = IncrementalDetokenizer(byte_fallback, [])
    assert [detok.add_tokens([i]).text for i in out] == ["", "", "中", "", FFFD + "a"]


def test_wrapper_tokenizer_is_accepted(bpe: Any) -> None:
    out = _encode(bpe, EMOJI)
    detok = IncrementalDetokenizer(Tokenizer(bpe), _encode(bpe, "Hi"))
    assert "".join(detok.add_tokens([i]).text for i in out) + detok.flush() == EMOJI


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(bpe: Any, skip: bool) -> None:
    out = _encode(bpe, "the end") + [bpe.eos_token_id]
    detok = IncrementalDetokenizer(bpe, [bpe.bos_token_id], skip_special_tokens=skip)
    text = detok.add_tokens(out).text + detok.flush()
    assert text == ("the end" if skip else "the end</s>")


# -- the prompt as context ----------------------------------------------------------------------


def test_first_token_reads_in_prompt_context(llama_style: Any) -> None:
    # The decoder strips a decode's leading space; the output's first word follows the prompt, so
    # its space must stay.
    prompt, out = _encode(llama_style, "Hello"), _encode(llama_style, "world")
    assert llama_style.convert_ids_to_tokens(out[:1]) == ["▁wo"] and llama_style.decode(out) == "world"
    detok = IncrementalDetokenizer(llama_style, prompt)
    assert "".join(detok.add_tokens([i]).text for i in out) + detok.flush() == " world"


def test_prompt_context_starting_inside_a_character(llama_style: Any) -> None:
    # The prompt's last 6 tokens start on the second byte of 字. A run of byte tokens that does not
    # start on a character decodes to U+FFFD throughout: the context must start after it.
    prompt = _encode(llama_style, "中文字😀")
    assert len(prompt) == 14 and llama_style.convert_ids_to_tokens(prompt[-6:])[0] == "<0xAD>"
    out = _encode(llama_style, "好")[1:]  # three byte tokens, continuing the prompt's run
    detok = IncrementalDetokenizer(llama_style, prompt)
    assert [detok.add_tokens([i]).text for i in out] == ["", "", "好"]
    assert detok.flush() == ""
    out = _encode(llama_style, "world")
    detok = IncrementalDetokenizer(llama_style, prompt)
    assert detok.add_tokens(out).text + detok.flush() == " world"  # the context (😀) was kept


def test_prompt_ending_inside_a_character(byte_fallback: Any) -> None:
    prompt = _encode(byte_fallback, "say 中")[:-1]  # the last byte of 中 is missing
    out = _encode(byte_fallback, "好ok")
    detok = IncrementalDetokenizer(byte_fallback, prompt)
    text = "".join(detok.add_tokens([i]).text for i in out) + detok.flush()
    assert text == byte_fallback.decode(out) == "好ok"


# -- flush --------------------------------------------------------------------------------------


def test_flush_releases_an_incomplete_character(tok: Any) -> None:
    out = _encode(tok, "ok 中")[:-1]  # the last byte of 中 never came
    detok = IncrementalDetokenizer(tok, _encode(tok, "Hi"))
    released = "".join(detok.add_tokens([i]).text for i in out)
    assert released == "ok "
    tail = detok.flush()
    assert tail.startswith(FFFD) and tail.strip(FFFD) == ""
    assert released + tail == detok.output_text == tok.decode(out)


def test_flush_releases_a_stop_prefix_that_never_completed(bpe: Any) -> None:
    out = _encode(bpe, "say ab")
    detok = IncrementalDetokenizer(bpe, [], stop=["abcX"])
    delta = detok.add_tokens(out)
    assert delta == DetokenizerDelta("say ", None)
    assert detok.flush() == "ab"
    assert detok.output_text == "say ab"
    assert detok.flush() == ""


# -- stop strings -------------------------------------------------------------------------------

STOP_CASES = [("code", "\n\n"), ("code", "return 3"), ("chinese", "公园"), ("emoji", "🇫🇷"), ("emoji", "👩‍👧")]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("grouping", ["one", "random:0", "random:1"])
@pytest.mark.parametrize(("name", "stop"), STOP_CASES)
def test_stop_string_across_token_boundaries(bpe: Any, name: str, stop: str, grouping: str, include: bool) -> None:
    text = TEXTS[name] + " tail"
    out = _encode(bpe, text)
    done = _completing_token(bpe, out, stop)
    assert stop not in bpe.decode([out[done]])  # the stop string spans tokens
    start = text.index(stop)
    detok, deltas = _stream(bpe, "Prompt: ", out, grouping, stop=["never", stop], include_stop_str_in_output=include)
    assert deltas[-1].stop_matched == stop and detok.stop_matched == stop
    assert all(d.stop_matched is None for d in deltas[:-1])
    expected = text[: start + len(stop)] if include else text[:start]
    assert "".join(d.text for d in deltas) == detok.output_text == expected
    assert detok.output_token_ids == out[: done + 1]  # tokens after the completing one are dropped
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens(out[done + 1 :] or [out[0]])


def test_possible_stop_start_is_held_then_released(bpe: Any) -> None:
    out = _encode(bpe, "x abc then abd")
    assert bpe.convert_ids_to_tokens(out[:3]) == ["x", "Ġabc", "Ġthen"]
    detok = IncrementalDetokenizer(bpe, [], stop=["abcX"])
    assert detok.add_tokens(out[:1]).text == "x"
    assert detok.add_tokens(out[1:2]).text == " "  # "abc" could start "abcX"
    assert detok.add_tokens(out[2:3]).text == "abc then"  # the match failed: out it comes
    rest = "".join(detok.add_tokens([i]).text for i in out[3:])
    assert detok.flush() == ""
    assert detok.output_text == "x abc then abd" and rest == " abd"


def test_earliest_stop_string_wins(bpe: Any) -> None:
    out = _encode(bpe, "hello world")
    for stops in (["world", "lo w"], ["lo w", "world"]):
        detok = IncrementalDetokenizer(bpe, [], stop=stops)
        delta = detok.add_tokens(out)
        assert delta == DetokenizerDelta("hel", "lo w")
    # at the same start, the shorter one, which completes first
    detok = IncrementalDetokenizer(bpe, [], stop=["world", "wor"], include_stop_str_in_output=True)
    assert detok.add_tokens(out) == DetokenizerDelta("hello wor", "wor")


def test_stop_string_matches_across_calls(byte_fallback: Any) -> None:
    out = _encode(byte_fallback, "ab中文cd")
    detok = IncrementalDetokenizer(byte_fallback, [], stop=["b中文c"])
    deltas = [detok.add_tokens([i]) for i in out[:9]]  # a b + 6 byte tokens + c
    assert [d.text for d in deltas] == ["a"] + [""] * 8
    assert deltas[-1].stop_matched == "b中文c"
    with pytest.raises(RuntimeError):
        detok.add_tokens(out[9:])


def test_add_tokens_after_flush_is_an_error(bpe: Any) -> None:
    detok = IncrementalDetokenizer(bpe, [])
    detok.add_tokens(_encode(bpe, "hi"))
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens(_encode(bpe, "there"))


@pytest.mark.parametrize("stop", [[""], ["ok", ""], ""])
def test_empty_stop_string_is_rejected(bpe: Any, stop: Any) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(bpe, [], stop=stop)
