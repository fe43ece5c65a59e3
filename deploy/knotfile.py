"""Local model files (.knot or .gguf) as mmap-backed QTensors."""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common import knot
from common.quant import QTensor


class LocalModel:
    """One interface over a .knot or a .gguf: header (architecture, hparams, tensors), tensor(name)."""

    path: Path
    header: Any  # KnotHeader or _GgufHeader: both have architecture, hparams, tensors

    def tensor(self, name: str) -> QTensor:
        e = self.header.tensors.get(name)
        if e is None:
            raise knot.UnknownTensor(f"unknown tensor {name!r} in {self.path.name} "
                                     f"({len(self.header.tensors)} tensors)")
        return QTensor(name, e.ggml_type, e.shape, self._raw(e))

    def has_tensor(self, name: str) -> bool:
        return name in self.header.tensors

    def tokenizer_data(self) -> dict:
        raise NotImplementedError

    def _raw(self, entry) -> np.ndarray:
        raise NotImplementedError


class KnotFile(LocalModel):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "rb")
        size = self.path.stat().st_size
        if size == 0:
            raise knot.TruncatedKnot(f"{self.path}: empty file, not a knot")
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._mm, dtype=np.uint8)
        self.header = knot.read_header_sync(lambda a, b: self._mm[a:b], file_size=size)

    def _raw(self, entry: knot.TensorEntry) -> np.ndarray:
        start = self.header.payload_offset + entry.offset
        return self.data[start:start + entry.length]

    def tokenizer_data(self) -> dict:
        a, b = self.header.blob_range(knot.TOKENIZER_BLOB)
        return knot.decode_tokenizer_blob(self._mm[a:b], self.header.blobs[knot.TOKENIZER_BLOB].encoding)


@dataclass(frozen=True)
class _GgufHeader:
    architecture: str
    hparams: dict
    tensors: dict[str, knot.TensorEntry]  # offset is absolute in the GGUF here


class GgufFile(LocalModel):
    def __init__(self, path: str | Path):
        from deploy.gguf_import import read_gguf

        self.path = Path(path)
        self._model = read_gguf(self.path)
        # The reader's bytes are an np.memmap, whose views each run memmap's __array_finalize__ in
        # Python: ~170 a decode step (every norm's and bias's float32 view). A plain ndarray over the
        # same map makes them C-level views.
        self._data = self._model.reader.data.view(np.ndarray)
        self.header = _GgufHeader(
            self._model.architecture,
            self._model.hparams,
            {t.name: knot.TensorEntry(t.name, t.ggml_type, t.shape, t.file_offset, t.length)
             for t in self._model.tensors},
        )

    def _raw(self, entry: knot.TensorEntry) -> np.ndarray:
        return self._data[entry.offset:entry.offset + entry.length]

    def tokenizer_data(self) -> dict:
        return self._model.tokenizer


def open_model(path: str | Path) -> LocalModel:
    """Open a .knot or .gguf by its magic bytes, whatever the file name says."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == knot.MAGIC:
        return KnotFile(path)
    if magic == b"GGUF":
        return GgufFile(path)
    raise knot.NotAKnot(f"{path}: neither a knot nor a GGUF (magic {magic!r})")
