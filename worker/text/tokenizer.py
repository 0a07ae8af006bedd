"""Tokenizer loading: Hugging Face's ``AutoTokenizer`` from the checkpoint folder, offline; for a
GGUF file, transformers' GGUF conversion of the file's own vocabulary, merges, special tokens and
chat template (``tokenizer.chat_template``), so that ``hf.apply_chat_template`` works the same for both."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftwise.worker.model.gguf import is_gguf_path, open_gguf
from draftwise.worker.model.model_config import ModelLoadError


@dataclass
class Tokenizer:
    """A thin wrapper: encode adds the model's special prefix (e.g. BOS) as its tokenizer says."""

    hf: Any  # transformers PreTrainedTokenizerBase

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, verbose=False))  # length is checked by the engine, not warned about

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for (special tokens included): a
        text of N bytes is at least N / max_token_bytes() tokens long."""
        longest = 1
        for i in range(len(self.hf)):
            longest = max(longest, len(self.hf.decode([i], skip_special_tokens=False).encode()))
        return longest


def load_tokenizer(folder: str | Path) -> Tokenizer:
    from transformers import AutoTokenizer

    folder = Path(folder)
    if is_gguf_path(folder):
        return _load_gguf_tokenizer(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json (or tokenizer.model) in the model folder")
    try:
        return Tokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}: tokenizer could not be loaded ({e})") from None


def _load_gguf_tokenizer(path: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    ckpt = open_gguf(path)  # a clear error for a missing, truncated or foreign file
    if "tokenizer.ggml.model" not in ckpt.metadata:
        raise ModelLoadError(f"{path}: the GGUF file carries no tokenizer (no 'tokenizer.ggml.model' metadata)")
    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"{path}: tokenizer could not be built from the GGUF file ({e})") from None
    return Tokenizer(hf)
