"""A GGUF file's tokenizer is converted once and read from the cache afterwards
(``draftwise.worker.text.tokenizer``): the cached one encodes, decodes and renders the chat
template exactly as the conversion does; a damaged entry is converted again; a cache that
cannot be written changes nothing but the time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from draftwise.worker.text import tokenizer as tokenizer_module
from draftwise.worker.text.tokenizer import gguf_tokenizer_cache, load_tokenizer
from tests.model.smollm2 import require_smollm2

TEXT = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()[:4000] + " héllo 世界 🙂 <|im_end|>"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


def _same(a, b) -> None:
    ids = a.encode(TEXT)
    assert ids == b.encode(TEXT)
    assert a.decode(ids) == b.decode(ids)
    assert a.decode(ids, skip_special_tokens=False) == b.decode(ids, skip_special_tokens=False)
    render = dict(tokenize=False, add_generation_prompt=True)
    assert a.hf.apply_chat_template(CHAT, **render) == b.hf.apply_chat_template(CHAT, **render)
    assert (a.eos_token_id, a.hf.bos_token_id, len(a.hf)) == (b.eos_token_id, b.hf.bos_token_id, len(b.hf))
    assert a.hf.all_special_ids == b.hf.all_special_ids


@pytest.fixture
def gguf(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path / "cache"))
    return require_smollm2()


def test_the_conversion_is_cached_and_the_cache_is_the_same_tokenizer(gguf, monkeypatch):
    converted = load_tokenizer(gguf)
    folder = gguf_tokenizer_cache(gguf)
    assert folder is not None and (folder / "tokenizer.json").is_file()
    real_open = tokenizer_module.open_gguf
    calls = []
    monkeypatch.setattr(tokenizer_module, "open_gguf", lambda p: calls.append(p) or real_open(p))
    cached = load_tokenizer(gguf)
    assert not calls, "the cached tokenizer was converted again"
    _same(converted, cached)


def test_the_direct_conversion_is_autotokenizers(gguf):
    """convert_gguf_tokenizer skips AutoTokenizer's read of the whole file: same tokenizer."""
    from transformers import AutoTokenizer

    from draftwise.worker.text.tokenizer import Tokenizer, convert_gguf_tokenizer

    direct = convert_gguf_tokenizer(gguf, "llama")
    auto = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    assert type(direct) is type(auto)
    assert direct.init_kwargs == auto.init_kwargs
    _same(Tokenizer(direct), Tokenizer(auto))


def test_a_damaged_entry_is_converted_again(gguf):
    first = load_tokenizer(gguf)
    folder = gguf_tokenizer_cache(gguf)
    assert folder is not None
    (folder / "tokenizer.json").write_text("{not json")
    again = load_tokenizer(gguf)
    _same(first, again)


def test_an_unwritable_cache_changes_nothing_but_the_time(gguf, tmp_path, monkeypatch):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(blocked))  # mkdir under a file fails
    tok = load_tokenizer(gguf)
    assert tok.encode("hello")
    assert not any(blocked.parent.glob("file-not-folder/*")) and blocked.is_file()


def test_another_file_at_the_same_path_gets_another_entry(tmp_path):
    path = tmp_path / "model.gguf"  # the key reads the file's path, size and time only
    path.write_bytes(b"GGUF" + bytes(60))
    before = gguf_tokenizer_cache(path)
    os.utime(path, ns=(1, 1))  # another file there: another modification time
    assert gguf_tokenizer_cache(path) != before
    path.write_bytes(b"GGUF" + bytes(61))
    assert gguf_tokenizer_cache(path) not in (before, None)
