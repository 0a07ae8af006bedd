"""Our GGUF container reader (worker/model/gguf_file.py) reads what gguf-py's GGUFReader reads:
on the real SmolLM2-135M-Instruct file and on tiny files of every supported tensor type, the
same metadata (the skipped tokenizer arrays aside), the same tensors (names, types, shapes,
bytes); malformed files raise GGUFFormatError."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from draftwise.worker.model.gguf import SUPPORTED_TYPES
from draftwise.worker.model.gguf_file import GGUFFormatError, read_gguf
from tests.model.smollm2 import require_smollm2
from tests.model.test_gguf import write_tiny_llama

SKIP = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


def _same_as_gguf_py(path: Path) -> None:
    ref = gguf.GGUFReader(path)
    ours = read_gguf(path, skip=SKIP)
    want = {k: f.contents() for k, f in ref.fields.items() if k not in SKIP and not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(want)
    for k, v in want.items():
        assert ours.metadata[k] == pytest.approx(v) if isinstance(v, float) else ours.metadata[k] == v, k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == int(b.tensor_type) and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_the_real_file_reads_as_gguf_py_reads_it():
    _same_as_gguf_py(require_smollm2())


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_tiny_files_of_every_type_read_as_gguf_py_reads_them(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_llama(path, qtype=qtype)
    _same_as_gguf_py(path)


def test_the_skipped_arrays_are_read_past_and_kept_when_asked():
    path = require_smollm2()
    kept = read_gguf(path)
    assert kept.metadata["tokenizer.ggml.tokens"] == gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    assert isinstance(kept.metadata["tokenizer.ggml.tokens"], list) and kept.metadata["tokenizer.ggml.tokens"]
    skipped = read_gguf(path, skip=SKIP)
    assert "tokenizer.ggml.tokens" not in skipped.metadata
    assert {k: v for k, v in kept.metadata.items() if k not in SKIP} == skipped.metadata


def test_malformed_files_raise_a_format_error(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    data = path.read_bytes()
    for n, words in ((3, "no GGUF magic"), (10, "ends inside its header"), (len(data) - 64, "runs past the end")):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFFormatError, match=words):
            read_gguf(cut)
    v1 = tmp_path / "v1.gguf"
    v1.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(GGUFFormatError, match="GGUF version 1"):
        read_gguf(v1)
