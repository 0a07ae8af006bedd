"""The GGUF container read directly: metadata and tensor table, tensors as memory-mapped views.

``gguf.GGUFReader`` parses every metadata value element by element through numpy views (4.3 s
for SmolLM2-135M's file, whose tokenizer arrays hold 98k strings: a quarter of a server's
start-up), though the model needs none of those arrays (the tokenizer reads them itself). This
reads the container (GGUF v2/v3: header, key/value pairs, tensor infos, aligned data) with
``struct`` over one memory map, skipping the arrays named in ``skip`` by their lengths alone, and
gives each tensor as GGUFReader would (the same dtype and shape for ``gguf.quants.dequantize``),
so dequantizing stays the maintained package's. Anything malformed raises ``GGUFFormatError``.
"""

from __future__ import annotations

import struct
from collections.abc import Container
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFFile", "GGUFFormatError", "GGUFTensor", "read_gguf"]


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF v2/v3 container (truncated, corrupt, another version)."""


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN = {0: np.float32, 1: np.float16, 28: np.float64, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64}
"""ggml types GGUFReader hands out as typed values (the others as raw bytes per row)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in ggml order (fastest dimension first) as GGUFReader gives it;
    ``data`` the memory-mapped values (plain types) or bytes per row (block types), rows first."""

    name: str
    tensor_type: int
    shape: np.ndarray
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, blob: np.ndarray) -> None:
        self.blob, self.pos = blob.data, 0  # the memory map as a buffer: struct reads it in place

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.blob):
            raise GGUFFormatError(f"ends inside its header (at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.blob):
            raise GGUFFormatError(f"a string of {n} bytes runs past the end (at byte {self.pos})")
        raw = bytes(self.blob[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"a string is not UTF-8 ({e})") from None

    def skip_string(self) -> None:
        n = self.take("<Q")  # (not ``self.pos += self.take(...)``: that adds to the position before the read)
        self.pos += n

    def value(self, kind: int, keep: bool) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        item, count = self.take("<I"), self.take("<Q")
        if not keep and item in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item])
            return None
        if not keep and item == _STRING:
            for _ in range(count):
                self.skip_string()
            return None
        return [self.value(item, keep) for _ in range(count)]


def read_gguf(path: Path, skip: Container[str] = ()) -> GGUFFile:
    """Metadata (the keys in ``skip`` left out, read past by their lengths) and tensors of ``path``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(blob)
    if bytes(blob[:4]) != b"GGUF":
        raise GGUFFormatError("no GGUF magic")
    version = cur.take("<4xI")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (draftwise reads versions 2 and 3)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        value = cur.value(cur.take("<I"), keep=key not in skip)
        if key not in skip:
            metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = int(metadata.get("general.alignment", 32))
    start = (cur.pos + align - 1) // align * align
    tensors, seen = [], set()
    for name, dims, kind, offset in infos:
        if name in seen:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has an unknown ggml type {kind}") from None
        block, size = GGML_QUANT_SIZES[qtype]
        rows_first = tuple(reversed(dims))
        n = prod(dims)
        if not rows_first:
            raise GGUFFormatError(f"tensor {name!r} has no dimensions")
        if rows_first[-1] % block:
            raise GGUFFormatError(f"tensor {name!r}: a row of {rows_first[-1]} is not whole {qtype.name} blocks")
        nbytes = n * size // block
        at = start + offset
        if at + nbytes > len(blob):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        plain = _PLAIN.get(kind)
        if plain is not None:
            data = blob[at : at + nbytes].view(plain).reshape(rows_first)
        else:
            data = blob[at : at + nbytes].reshape((*rows_first[:-1], rows_first[-1] // block * size))
        tensors.append(GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), data))
    return GGUFFile(path, metadata, tensors)
