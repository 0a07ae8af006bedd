"""Tokenizer loading: Hugging Face's ``AutoTokenizer`` from the checkpoint folder, offline; for a
GGUF file, transformers' GGUF conversion of the file's own vocabulary, merges, special tokens and
chat template (``tokenizer.chat_template``), so that ``hf.apply_chat_template`` works the same for both.

The GGUF conversion takes seconds of Python (2 s for SmolLM2's 49k-token vocabulary on the 2-core
development machine through :func:`convert_gguf_tokenizer`; 8.7 s through ``AutoTokenizer``), so its result is saved once, as a tokenizer
folder, under ``$DRAFTWISE_CACHE_DIR/tokenizers`` (default ``$XDG_CACHE_HOME/draftwise`` or
``~/.cache/draftwise``), keyed by the file's path, size and modification time and by the
transformers version; later loads read that folder (a fraction of a second). A cache that cannot
be written is skipped (the conversion is used as it is)."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from draftwise.worker.model.gguf import is_gguf_path, open_gguf
from draftwise.worker.model.model_config import ModelLoadError
from draftwise.worker.paths import draftwise_cache_dir

log = structlog.get_logger("draftwise.tokenizer")


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

    cached = gguf_tokenizer_cache(path)
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            return Tokenizer(AutoTokenizer.from_pretrained(str(cached), local_files_only=True))
        except (OSError, ValueError) as e:  # a damaged entry: built again below
            log.warning("cached tokenizer unreadable, converting the GGUF file again", folder=str(cached), error=str(e))
    ckpt = open_gguf(path)  # a clear error for a missing, truncated or foreign file
    if "tokenizer.ggml.model" not in ckpt.metadata:
        raise ModelLoadError(f"{path}: the GGUF file carries no tokenizer (no 'tokenizer.ggml.model' metadata)")
    try:
        hf = convert_gguf_tokenizer(path, ckpt.architecture)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"{path}: tokenizer could not be built from the GGUF file ({e})") from None
    if cached is not None:
        _save(hf, cached)
    return Tokenizer(hf)


def convert_gguf_tokenizer(path: Path, architecture: str) -> Any:
    """Transformers' tokenizer for the GGUF file ``path``: what ``AutoTokenizer`` builds, without
    its detour. For a Llama file (in a folder with no ``tokenizer_config.json`` to name another
    class) AutoTokenizer reads the whole file's metadata with gguf-py (5 s of Python for SmolLM2)
    only to learn that the model type is "llama", for which transformers maps no tokenizer class,
    and then builds the generic ``TokenizersBackend`` from transformers' own fast GGUF reader:
    this builds that directly (2 s). Any other file goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    kw: dict[str, Any] = {"gguf_file": path.name, "local_files_only": True}
    if architecture == "llama" and not (path.parent / "tokenizer_config.json").exists():
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        if "llama" not in TOKENIZER_MAPPING_NAMES:  # AutoTokenizer's choice for the type, as above
            return TokenizersBackend.from_pretrained(str(path.parent), **kw)
    return AutoTokenizer.from_pretrained(str(path.parent), **kw)


def gguf_tokenizer_cache(path: Path) -> Path | None:
    """The cache folder of ``path``'s converted tokenizer (None when the file cannot be read)."""
    import transformers

    try:
        st = path.resolve().stat()
    except OSError:
        return None
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|transformers {transformers.__version__}"
    return draftwise_cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save(hf: Any, folder: Path) -> None:
    """Save ``hf`` as ``folder``, whole or not at all (written aside, then renamed)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".part-", dir=folder.parent))
        hf.save_pretrained(str(tmp))
        try:
            tmp.rename(folder)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        log.info("tokenizer cache not written", folder=str(folder), error=str(e))
