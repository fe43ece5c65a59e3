"""GGUF -> .knot. Tensor bytes are copied verbatim: nothing is requantized.

Two passes over the GGUF: the first computes each tensor's crc32 and chunk digests (the header,
written first, carries them), the second copies the bytes. The first pass is SHA-256 bound.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from tqdm import tqdm

from common import knot
from deploy.gguf_import import read_gguf

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 16 << 20


def encode(gguf_path: str | Path, knot_path: str | Path, progress: bool | None = None) -> knot.KnotHeader:
    """Encode a GGUF into a knot at knot_path (written to a temp name, then renamed)."""
    model = read_gguf(gguf_path)
    tok_blob = knot.encode_tokenizer_blob(model.tokenizer)
    checksums = {t.name: _checksum(model.raw(t)) for t in model.tensors}
    checksums[knot.TOKENIZER_BLOB] = knot.checksum(tok_blob)
    metadata = knot.build_metadata(
        model.architecture,
        model.hparams,
        [(t.name, t.ggml_type, t.shape, t.length) for t in model.tensors],
        blobs=[(knot.TOKENIZER_BLOB, len(tok_blob), knot.TOKENIZER_ENCODING)],
        extra={"name": model.name, "source": Path(gguf_path).name},
        checksums=checksums,
    )
    head = knot.pack_header(metadata)
    header = knot.parse_header(head)  # round-trip: the writer never emits what the reader rejects
    total = header.payload_nbytes
    if progress is None:
        progress = sys.stderr.isatty()

    knot_path = Path(knot_path)
    tmp = knot_path.with_name(f"{knot_path.name}.{os.getpid()}.partial")  # two encoders never share one
    with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                      desc=f"encode {knot_path.name}", disable=not progress) as bar:
        out.write(head)
        for t in model.tensors:
            raw = model.raw(t)
            for a in range(0, t.length, COPY_CHUNK_BYTES):
                chunk = raw[a:a + COPY_CHUNK_BYTES]
                out.write(chunk.tobytes() if hasattr(chunk, "tobytes") else chunk)
                bar.update(len(chunk))
        out.write(tok_blob)
        bar.update(len(tok_blob))
    size = tmp.stat().st_size
    header.check_size(size)
    os.replace(tmp, knot_path)
    log.info("encoded %s -> %s: %d tensors, header %d B, payload %d B", gguf_path, knot_path,
             len(header.tensors), header.payload_offset, total)
    return header


def _checksum(raw) -> knot.EntryChecksum:
    """crc32 and chunk digests of a tensor's bytes (a numpy view into the GGUF's mmap), in pieces."""
    h = knot.EntryHasher()
    for a in range(0, len(raw), COPY_CHUNK_BYTES):
        h.update(raw[a:a + COPY_CHUNK_BYTES])
    return h.result()
