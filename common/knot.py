"""The .knot container: one object holding a model's quantized tensors and metadata.

Layout (seed section 5; docs/knot-format.md is the long form):

    bytes 0..3          b"KNOT"
    bytes 4..5          u16 LE version (2)
    bytes 6..9          u32 LE metaLen = UNPADDED length of the JSON
    bytes 10..10+metaLen  JSON metadata (UTF-8), no trailing padding
    ..align-1           NUL pad to a 4-byte boundary (0..3 bytes)
    byte  align         codec marker 0x40, align = (10 + metaLen + 3) & ~3
    bytes align+1..     payload: tensors, contiguous in metadata order, then blobs

Version 2 adds per-chunk digests: every tensor and blob entry carries "chunks", the first 8 bytes
of SHA-256 of each CHUNK_BYTES piece of its bytes, so any range a reader takes is checked by the
chunks it touches (verify_range). The knot's digest, SHA-256 of the header bytes, commits to every
chunk digest and so to every byte: it is what an operator pins (KNOT_DIGEST).

Pure: no file or network I/O here. Readers pass a `read_range(start, end)` callable.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Mapping

from common.integrity import crc32
from common.quant import QUANT_TYPES, row_byte_range, tensor_nbytes

MAGIC = b"KNOT"
VERSION = 2  # 2: per-chunk digests ("chunk_bytes", each entry's "chunks"); 1 is refused
CHUNK_BYTES = 64 * 1024  # what the writers use; a reader takes the header's "chunk_bytes"
CHUNK_DIGEST_BYTES = 8  # the leading bytes of each chunk's SHA-256 kept in the header
MARKER = 0x40  # "FP64 codec marker" byte that sits just before the payload
PREAMBLE = struct.Struct("<4sHI")  # magic, version, metaLen -> 10 bytes
# First fetch of a reader. The real models' headers are larger (158 KB for the 0.5B, most of it
# chunk digests): they cost one more ranged read (the seed's two-fetch case).
PROBE_BYTES = 64 * 1024

HPARAM_KEYS = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "head_count",
    "head_count_kv",
    "rope_freq_base",
    "rms_eps",
    "context_length",
    "vocab_size",
)


class KnotError(ValueError):
    """Base of every error raised while reading a knot."""


class NotAKnot(KnotError):
    pass


class TruncatedKnot(KnotError):
    pass


class StaleKnotError(KnotError):
    """The layout disagrees with itself: a pre-2026-04-25 encoding or a cut-off file."""


class CorruptKnot(KnotError):
    """A tensor's or blob's bytes disagree with the CRC-32 or a chunk digest the knot header carries."""


class OldKnotVersion(KnotError):
    """A knot of a format version this reader no longer reads (version 1: no chunk digests)."""


class UnknownTensor(KnotError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def payload_offset_for(meta_len: int) -> int:
    """Absolute offset of the payload for an UNPADDED metadata length."""
    align = (PREAMBLE.size + meta_len + 3) & ~3
    return align + 1


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # GGUF order: ne0 (row length) first
    offset: int  # from the payload start
    length: int  # bytes
    # Of the tensor's bytes: the parser requires both in a knot; a GGUF's entries (deploy/knotfile.py) have none.
    crc32: int | None = None
    chunks: bytes = field(default=b"", repr=False)  # CHUNK_DIGEST_BYTES per chunk of the tensor's bytes

    @property
    def n_rows(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n


@dataclass(frozen=True)
class BlobEntry:
    name: str
    offset: int  # from the payload start, after the tensors
    length: int
    encoding: str  # e.g. "zlib+json"
    crc32: int  # of the blob's bytes (as stored)
    chunks: bytes = field(repr=False)  # CHUNK_DIGEST_BYTES per chunk of the blob's bytes


@dataclass(frozen=True)
class KnotHeader:
    version: int
    meta_len: int
    payload_offset: int
    digest: str  # SHA-256 (hex) of bytes [0, payload_offset): names this knot's every byte
    chunk_bytes: int
    metadata: dict = field(repr=False)
    tensors: dict[str, TensorEntry] = field(repr=False)
    blobs: dict[str, BlobEntry] = field(repr=False)

    @property
    def architecture(self) -> str:
        return self.metadata["architecture"]

    @property
    def hparams(self) -> dict:
        return self.metadata["hparams"]

    @property
    def payload_nbytes(self) -> int:
        return sum(t.length for t in self.tensors.values()) + sum(b.length for b in self.blobs.values())

    @property
    def expected_file_size(self) -> int:
        return self.payload_offset + self.payload_nbytes

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise UnknownTensor(f"unknown tensor {name!r}: the knot has {len(self.tensors)} tensors "
                                f"(e.g. {', '.join(list(self.tensors)[:3])})") from None

    def tensor_range(self, name: str) -> tuple[int, int]:
        """Absolute [start, end) file offsets of a tensor's bytes."""
        t = self.entry(name)
        start = self.payload_offset + t.offset
        return start, start + t.length

    def row_range(self, name: str, row_start: int, row_end: int) -> tuple[int, int]:
        """Absolute [start, end) file offsets of rows [row_start, row_end) of a tensor."""
        t = self.entry(name)
        if not 0 <= row_start <= row_end <= t.n_rows:
            raise KnotError(f"rows {row_start}:{row_end} out of range for {name} with {t.n_rows} rows")
        a, b = row_byte_range(t.ggml_type, t.shape[0], row_start, row_end)
        base = self.payload_offset + t.offset
        return base + a, base + b

    def blob_range(self, name: str) -> tuple[int, int]:
        try:
            b = self.blobs[name]
        except KeyError:
            raise KnotError(f"the knot has no blob {name!r} (blobs: {sorted(self.blobs)})") from None
        start = self.payload_offset + b.offset
        return start, start + b.length

    def entry_range(self, name: str) -> tuple[int, int]:
        """Absolute [start, end) file offsets of a tensor's or a blob's bytes."""
        return self.tensor_range(name) if name in self.tensors else self.blob_range(name)

    def _any_entry(self, name: str) -> TensorEntry | BlobEntry:
        e = self.tensors.get(name) or self.blobs.get(name)
        if e is None:
            raise UnknownTensor(f"unknown tensor or blob {name!r}")
        return e

    def verify(self, name: str, data: bytes | memoryview) -> None:
        """Check a whole tensor's (or blob's) bytes against the header's crc32 and every chunk digest;
        CorruptKnot on a mismatch."""
        self.verify_crc(name, crc32(data), len(data))
        self.verify_range(name, 0, len(data), data)

    def verify_crc(self, name: str, crc: int, nbytes: int) -> None:
        """The crc32 half of verify, from the crc32 of the bytes (e.g. a tensor frame's payload_crc32)."""
        e = self._any_entry(name)
        kind = "tensor" if name in self.tensors else "blob"
        if nbytes != e.length:
            raise CorruptKnot(f"{kind} {name}: {nbytes} bytes, the knot header says {e.length}")
        if crc != e.crc32:
            raise CorruptKnot(f"{kind} {name}: crc32 0x{crc:08x} over {nbytes} bytes, the knot header says "
                              f"0x{e.crc32:08x}: the knot's bytes are corrupt or were changed without re-encoding")

    def chunk_span(self, name: str, rel_start: int, rel_end: int) -> tuple[int, int]:
        """[rel_start, rel_end) of an entry's bytes widened to whole chunks: the [a, b) to read and verify."""
        e = self._any_entry(name)
        if not 0 <= rel_start <= rel_end <= e.length:
            raise KnotError(f"{name}: bytes {rel_start}:{rel_end} out of range for an entry of {e.length} bytes")
        c = self.chunk_bytes
        return rel_start // c * c, min(e.length, -(-rel_end // c) * c)

    def verify_range(self, name: str, rel_start: int, rel_end: int, data: bytes | memoryview) -> None:
        """Check bytes [rel_start, rel_end) of an entry (chunk-aligned, as chunk_span gives) against its
        chunk digests; CorruptKnot naming the chunk and its byte range on a mismatch."""
        e = self._any_entry(name)
        if self.chunk_span(name, rel_start, rel_end) != (rel_start, rel_end):
            raise KnotError(f"{name}: bytes {rel_start}:{rel_end} are not whole chunks of {self.chunk_bytes} "
                            f"(widen them with chunk_span)")
        kind = "tensor" if name in self.tensors else "blob"
        if len(data) != rel_end - rel_start:
            raise CorruptKnot(f"{kind} {name}: {len(data)} bytes read for bytes {rel_start}:{rel_end}")
        view, c, d = memoryview(data).cast("B"), self.chunk_bytes, CHUNK_DIGEST_BYTES
        for a in range(rel_start, rel_end, c):
            i = a // c
            got = hashlib.sha256(view[a - rel_start:a - rel_start + c]).digest()[:d]
            if got != e.chunks[i * d:(i + 1) * d]:
                b = min(a + c, e.length)
                raise CorruptKnot(f"{kind} {name}: chunk {i} (bytes {a}:{b} of the {kind}) has SHA-256 prefix "
                                  f"{got.hex()}, the knot header says {e.chunks[i * d:(i + 1) * d].hex()}: the "
                                  f"knot's bytes are corrupt or were changed without re-encoding")

    def check_size(self, file_size: int) -> None:
        """The stale-knot guard (seed section 5, WARNING)."""
        want = self.expected_file_size
        if file_size == want:
            return
        if want - file_size == 1:
            hint = ("the payload starts one byte before payloadOffset: the signature of the "
                    "pre-2026-04-25 encoder that padded the JSON inside metaLen")
        elif file_size < want:
            hint = "the file is cut short (truncated download or upload?)"
        else:
            hint = "there are bytes the header does not account for"
        raise StaleKnotError(
            f"stale or broken knot: file size {file_size} bytes != payloadOffset {self.payload_offset} "
            f"+ payload total {self.payload_nbytes} = {want}; {hint}. Knots written by the pre-2026-04-25 "
            f"encoder (padded metaLen) read as NaN-laced weights: re-encode with `knot encode MODEL.gguf OUT.knot`"
        )


# ---------------------------------------------------------------- writing

@dataclass(frozen=True)
class EntryChecksum:
    crc32: int  # of the entry's bytes
    chunks: str  # hex: CHUNK_DIGEST_BYTES of SHA-256 per CHUNK_BYTES chunk of the entry's bytes


class EntryHasher:
    """The crc32 and chunk digests of one entry's bytes, fed in pieces of any size (a writer's stream)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self.crc = 0
        self._digests: list[bytes] = []
        self._sha = hashlib.sha256()
        self._filled = 0  # bytes of the current chunk hashed so far

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self.crc = crc32(view, self.crc)
        while len(view):
            take = min(len(view), self.chunk_bytes - self._filled)
            self._sha.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._end_chunk()

    def _end_chunk(self) -> None:
        self._digests.append(self._sha.digest()[:CHUNK_DIGEST_BYTES])
        self._sha, self._filled = hashlib.sha256(), 0

    def result(self) -> EntryChecksum:
        if self._filled:  # the last chunk may be shorter
            self._end_chunk()
        return EntryChecksum(self.crc, b"".join(self._digests).hex())


def checksum(data) -> EntryChecksum:
    """The crc32 and chunk digests of an entry's bytes in hand."""
    h = EntryHasher()
    h.update(data)
    return h.result()


def build_metadata(
    architecture: str,
    hparams: Mapping[str, Any],
    tensors: Iterable[tuple[str, str, tuple[int, ...], int]],
    blobs: Iterable[tuple[str, int, str]] = (),
    extra: Mapping[str, Any] | None = None,
    checksums: Mapping[str, EntryChecksum] | None = None,
) -> dict:
    """Metadata with offsets laid out contiguously: tensors in the given order, then blobs.

    tensors: (name, ggml_type, shape GGUF order, length bytes); blobs: (name, length, encoding);
    checksums: tensor or blob name -> its EntryChecksum, required for every one (EntryHasher, checksum).
    """
    checksums = checksums or {}
    missing = [k for k in HPARAM_KEYS if k not in hparams]
    if missing:
        raise KnotError(f"hparams lack {missing}")
    meta: dict[str, Any] = {"format": "knot", "version": VERSION, "architecture": architecture,
                            "chunk_bytes": CHUNK_BYTES, "hparams": dict(hparams)}
    if extra:
        meta.update(extra)
    offset = 0
    table: dict[str, dict] = {}
    for name, ggml_type, shape, length in tensors:
        table[name] = {"type": ggml_type, "shape": list(shape), "offset": offset, "length": length,
                       **_checksum_fields(name, checksums)}
        offset += length
    meta["tensors"] = table
    blob_table: dict[str, dict] = {}
    for name, length, encoding in blobs:
        blob_table[name] = {"offset": offset, "length": length, "encoding": encoding,
                            **_checksum_fields(name, checksums)}
        offset += length
    meta["blobs"] = blob_table
    return meta


def _checksum_fields(name: str, checksums: Mapping[str, EntryChecksum]) -> dict:
    if name not in checksums:
        raise KnotError(f"{name}: no checksum given; a version {VERSION} knot carries one for every tensor and blob")
    return {"crc32": checksums[name].crc32, "chunks": checksums[name].chunks}


def pack_header(metadata: Mapping[str, Any]) -> bytes:
    """Bytes 0..payloadOffset-1 of a knot: preamble, JSON, NUL pad, marker."""
    meta = json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    # metaLen is the UNPADDED length; padding goes after the JSON, outside metaLen.
    # (The pre-fix encoder padded inside metaLen: the reader then lands one byte late.)
    pad = (4 - (PREAMBLE.size + len(meta)) % 4) % 4
    out = PREAMBLE.pack(MAGIC, VERSION, len(meta)) + meta + b"\x00" * pad + bytes([MARKER])
    assert len(out) == payload_offset_for(len(meta)), (len(out), len(meta))
    return out


# ---------------------------------------------------------------- reading

def header_nbytes(prefix: bytes) -> int:
    """How many leading bytes parse_header needs, from the first 10."""
    if len(prefix) < PREAMBLE.size:
        raise TruncatedKnot(f"knot too short: {len(prefix)} bytes, the preamble alone is {PREAMBLE.size}")
    magic, _version, meta_len = PREAMBLE.unpack_from(prefix)
    if magic != MAGIC:
        raise NotAKnot(f"not a knot: magic {magic!r}, expected {MAGIC!r}")
    return payload_offset_for(meta_len)


def parse_header(buf: bytes, file_size: int | None = None) -> KnotHeader:
    """Parse a knot header from its leading bytes; with file_size, also run the stale guard."""
    need = header_nbytes(buf)
    magic, version, meta_len = PREAMBLE.unpack_from(buf)
    if version < VERSION:
        raise OldKnotVersion(f"knot format version {version} has no per-chunk checksums, and this reader reads "
                             f"only version {VERSION}: re-encode it with `knot encode MODEL.gguf OUT.knot` "
                             f"(`knot fetch-model --encode` re-encodes a cached one)")
    if version != VERSION:
        raise KnotError(f"unsupported knot version {version}; this reader knows version {VERSION}")
    if len(buf) < need:
        raise TruncatedKnot(f"knot header truncated: metaLen {meta_len} needs {need} bytes, got {len(buf)}")
    try:
        metadata = json.loads(bytes(buf[PREAMBLE.size:PREAMBLE.size + meta_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KnotError(f"knot metadata is not valid JSON ({e}); stale or corrupt knot, re-encode it") from None
    if not isinstance(metadata, dict) or metadata.get("format") != "knot":
        raise NotAKnot("knot metadata lacks \"format\": \"knot\"")
    if metadata.get("version") != version:
        raise KnotError(f"knot metadata says version {metadata.get('version')!r}, the preamble {version}")
    chunk_bytes = metadata.get("chunk_bytes")
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or not 0 < chunk_bytes <= 1 << 30:
        raise KnotError(f"knot metadata: chunk_bytes {chunk_bytes!r} is not an integer in (0, 2^30]")
    tensors = _parse_tensor_table(metadata.get("tensors"), chunk_bytes)
    blob_table = metadata.get("blobs", {})
    if not isinstance(blob_table, dict):
        raise KnotError("knot metadata: \"blobs\" is not a table")
    blobs = {}
    for name, b in blob_table.items():
        length = int(b["length"])
        blobs[name] = BlobEntry(name, int(b["offset"]), length, str(b.get("encoding", "raw")),
                                _parse_crc(name, b), _parse_chunks(name, b, length, chunk_bytes))
    digest = hashlib.sha256(bytes(buf[:need])).hexdigest()
    header = KnotHeader(version, meta_len, need, digest, chunk_bytes, metadata, tensors, blobs)
    if file_size is not None:
        header.check_size(file_size)
    marker = buf[need - 1]
    if marker != MARKER:
        # A second, independent symptom of a misplaced payload.
        raise StaleKnotError(f"stale or broken knot: byte {need - 1} is 0x{marker:02x}, expected the codec "
                             f"marker 0x{MARKER:02x} just before payloadOffset {need}; re-encode with `knot encode`")
    return header


def _parse_tensor_table(table: Any, chunk_bytes: int) -> dict[str, TensorEntry]:
    if not isinstance(table, dict):
        raise KnotError("knot metadata lacks a \"tensors\" table")
    out: dict[str, TensorEntry] = {}
    expect_offset = 0
    for name, t in table.items():
        # "type" is the on-disk name; "tensor_type" is the backend-shaped alias that a
        # reader must also accept (seed section 8: reading the wrong one gave undefined -> zeros).
        ggml_type = t.get("type", t.get("tensor_type"))
        if ggml_type is None:
            raise KnotError(f"tensor {name}: metadata has neither \"type\" nor \"tensor_type\"")
        length = int(t["length"])
        entry = TensorEntry(name, str(ggml_type), tuple(int(d) for d in t["shape"]), int(t["offset"]), length,
                            _parse_crc(name, t), _parse_chunks(name, t, length, chunk_bytes))
        if entry.offset != expect_offset:
            raise KnotError(f"tensor {name}: offset {entry.offset}, expected {expect_offset} "
                            f"(tensors lie contiguous in metadata order)")
        if entry.ggml_type in QUANT_TYPES:
            want = tensor_nbytes(entry.ggml_type, entry.shape)
            if entry.length != want:
                raise KnotError(f"tensor {name}: length {entry.length} bytes, expected {want} "
                                f"for {entry.ggml_type} {list(entry.shape)}")
        expect_offset += entry.length
        out[name] = entry
    return out


def _parse_crc(name: str, entry: Mapping[str, Any]) -> int:
    """The "crc32" of a tensor or blob entry: an integer in [0, 2^32)."""
    crc = entry.get("crc32")
    if not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 1 << 32:
        raise KnotError(f"{name}: crc32 {crc!r} is not an unsigned 32-bit integer")
    return crc


def _parse_chunks(name: str, entry: Mapping[str, Any], length: int, chunk_bytes: int) -> bytes:
    """The "chunks" of a tensor or blob entry: hex, CHUNK_DIGEST_BYTES per chunk of its length."""
    text = entry.get("chunks")
    if length < 0:
        raise KnotError(f"{name}: length {length} is negative")
    n = -(-length // chunk_bytes)
    want = 2 * CHUNK_DIGEST_BYTES * n
    if not isinstance(text, str) or len(text) != want:
        got = f"{len(text)} hex digits" if isinstance(text, str) else repr(text)
        raise KnotError(f"{name}: chunks is {got}, expected {want} ({n} chunks of {chunk_bytes} bytes over "
                        f"{length} bytes, {CHUNK_DIGEST_BYTES} bytes each)")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != want // 2:  # fromhex also skips whitespace
        raise KnotError(f"{name}: chunks is not {want} hexadecimal digits")
    return raw


ReadRange = Callable[[int, int], Awaitable[bytes]]


async def read_header(read_range: ReadRange, file_size: int | None = None,
                      probe_bytes: int = PROBE_BYTES) -> KnotHeader:
    """Read a header through a ranged reader: one probe, plus one more read if metaLen needs it."""
    buf = await read_range(0, probe_bytes)
    need = header_nbytes(buf)
    if len(buf) < need:
        if len(buf) < probe_bytes:
            raise TruncatedKnot(f"knot header truncated: needs {need} bytes, the object has {len(buf)}")
        buf = bytes(buf) + await read_range(len(buf), need)
    return parse_header(buf, file_size)


def read_header_sync(read_range: Callable[[int, int], bytes], file_size: int | None = None,
                     probe_bytes: int = PROBE_BYTES) -> KnotHeader:
    """Same as read_header, for a blocking reader (local files)."""
    buf = read_range(0, probe_bytes)
    need = header_nbytes(buf)
    if len(buf) < need:
        if len(buf) < probe_bytes:
            raise TruncatedKnot(f"knot header truncated: needs {need} bytes, the file has {len(buf)}")
        buf = bytes(buf) + read_range(len(buf), need)
    return parse_header(buf, file_size)


# ---------------------------------------------------------------- blobs

TOKENIZER_BLOB = "tokenizer"
TOKENIZER_ENCODING = "zlib+json"


def encode_tokenizer_blob(data: Mapping[str, Any]) -> bytes:
    """Tokenizer data (schema in docs/knot-format.md) -> blob bytes. Kept out of the header JSON,
    which every station and shard reads at boot: 151,936 tokens + 151,387 merges would make it ~6 MB."""
    import zlib

    return zlib.compress(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8"), 6)


def decode_tokenizer_blob(blob: bytes, encoding: str = TOKENIZER_ENCODING) -> dict:
    import zlib

    if encoding != TOKENIZER_ENCODING:
        raise KnotError(f"tokenizer blob encoding {encoding!r} is not {TOKENIZER_ENCODING!r}")
    try:
        return json.loads(zlib.decompress(blob).decode("utf-8"))
    except (zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KnotError(f"tokenizer blob is corrupt ({e}); re-encode the knot") from None
