"""Binary frames between services. All integers little-endian. Pure (stdlib only).

Tensor frame (the wardens' self-checking frame), version 1:

    off  size  field
    0    4     magic        b"KTNS"
    4    1     version      1
    5    1     flags        0 (reserved; a decoder rejects unknown bits)
    6    2     name_len     u16, bytes of the UTF-8 tensor name
    8    1     type_len     u8, bytes of the ASCII ggml type name ("Q4_K", "F32", ...)
    9    1     ndim         u8, number of shape dims
    10   2     reserved     0
    12   8     row_start    u64, first row of the tensor this frame holds (0 for a whole tensor)
    20   8     payload_len  u64, bytes of payload
    28   ..    name         name_len bytes
    ..   ..    ggml_type    type_len bytes
    ..   8*nd  shape        u64 each, GGUF order [ne0, ne1, ...] of the rows held (not the whole tensor)
    ..   ..    payload      payload_len bytes: raw tensor bytes as stored in the knot
    ..   4     crc32        CRC-32 (zlib's) of every byte above, from the magic on

Batch, version 1:

    0    4     magic        b"KTBT"
    4    1     version      1
    5    1     flags        0
    6    2     reserved     0
    8    4     count        u32, number of tensor frames that follow
    12   ..    frames       `count` tensor frames back to back, nothing after them

Decoders raise a WireError subclass whose message names the field and the numbers.
The hop envelope (b"KENV", below) has its own magic and reuses _Reader; the wardens' request
bodies (names, row ids) are at the end. docs/wire.md describes every frame.
"""
from __future__ import annotations

import bisect
import itertools
import struct
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from common.integrity import crc32, crc32_combine

TENSOR_MAGIC = b"KTNS"
BATCH_MAGIC = b"KTBT"
VERSION = 1

TENSOR_CONTENT_TYPE = "application/x-knot-tensor"
BATCH_CONTENT_TYPE = "application/x-knot-tensor-batch"

_TENSOR_HEAD = struct.Struct("<4sBBHBBHQQ")  # magic version flags name_len type_len ndim reserved row_start payload_len
_BATCH_HEAD = struct.Struct("<4sBBHI")  # magic version flags reserved count
_CRC = struct.Struct("<I")
_U64 = struct.Struct("<Q")
MAX_NDIM = 8


class WireError(ValueError):
    """Base of every frame decoding error."""


class BadMagic(WireError):
    pass


class UnsupportedVersion(WireError):
    pass


class TruncatedFrame(WireError):
    pass


class ChecksumMismatch(WireError):
    pass


class MalformedFrame(WireError):
    pass


@dataclass(frozen=True)
class TensorFrame:
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # GGUF order, of the rows this frame holds
    payload: bytes | memoryview  # decoded frames: a read-only view into the received buffer
    row_start: int = 0
    # crc32 of payload alone. Decoded frames carry it (checked through the frame's crc32), so a
    # reader can compare it with the knot header's; an encoder given it skips its own pass.
    payload_crc32: int | None = field(default=None, compare=False)


class _Reader:
    """Bounds-checked cursor over a body: one buffer, or the buffers it concatenates (Response.parts).
    Every short read names the field it wanted."""

    def __init__(self, buf: bytes | memoryview | Sequence[bytes | memoryview], what: str):
        parts = [memoryview(p).cast("B") for p in ((buf,) if isinstance(buf, (bytes, bytearray, memoryview)) else buf)]
        self.parts = [p for p in parts if p.nbytes] or [memoryview(b"")]
        self.starts = list(itertools.accumulate((p.nbytes for p in self.parts), initial=0))
        self.size = self.starts[-1]
        self.pos = 0
        self.what = what

    def span(self, a: int, b: int) -> memoryview:
        """Bytes [a, b) of the body: a view where one part holds them all (a frame in its own block,
        as a LayerWarden sends its large ones), a joined copy where they cross parts."""
        if len(self.parts) == 1:  # the usual body: one buffer
            return self.parts[0][a:b]
        i = bisect.bisect_right(self.starts, a) - 1
        if i < len(self.parts) and b <= self.starts[i + 1]:
            return self.parts[i][a - self.starts[i]:b - self.starts[i]]
        out, at = bytearray(), a
        while at < b:
            i = bisect.bisect_right(self.starts, at) - 1
            piece = self.parts[i][at - self.starts[i]:min(b, self.starts[i + 1]) - self.starts[i]]
            out += piece
            at += piece.nbytes
        return memoryview(bytes(out))

    def take(self, n: int, field: str) -> memoryview:
        if n > self.size - self.pos:
            raise TruncatedFrame(f"{self.what}: {field} needs {n} bytes at offset {self.pos}, "
                                 f"only {self.size - self.pos} left of {self.size}")
        out = self.span(self.pos, self.pos + n)
        self.pos += n
        return out

    def unpack(self, st: struct.Struct, field: str) -> tuple:
        return st.unpack(self.take(st.size, field))

    def remaining(self) -> int:
        return self.size - self.pos


def _check_magic_version(what: str, magic: bytes, want_magic: bytes, version: int, flags: int) -> None:
    if magic != want_magic:
        raise BadMagic(f"{what}: magic {bytes(magic)!r}, expected {want_magic!r}")
    if version != VERSION:
        raise UnsupportedVersion(f"{what}: version {version}, this decoder knows version {VERSION}")
    if flags != 0:
        raise MalformedFrame(f"{what}: unknown flags 0x{flags:02x}")


# ---------------------------------------------------------------- tensor frame


def encode_tensor(frame: TensorFrame) -> bytes:
    name = frame.name.encode("utf-8")
    gtype = frame.ggml_type.encode("ascii")
    if len(name) > 0xFFFF or len(gtype) > 0xFF or len(frame.shape) > MAX_NDIM:
        raise ValueError(f"tensor frame {frame.name!r}: name {len(name)} B, type {len(gtype)} B, "
                         f"ndim {len(frame.shape)} exceed the frame's field sizes")
    head = _TENSOR_HEAD.pack(TENSOR_MAGIC, VERSION, 0, len(name), len(gtype), len(frame.shape), 0,
                             frame.row_start, len(frame.payload))
    meta = head + name + gtype + b"".join(_U64.pack(d) for d in frame.shape)
    payload_crc = crc32(frame.payload) if frame.payload_crc32 is None else frame.payload_crc32
    # A payload_crc32 that is not the payload's (a cache entry changed since it was sealed) gives a
    # frame whose crc32 the decoder rejects.
    crc = crc32_combine(crc32(meta), payload_crc, len(frame.payload))
    return b"".join((meta, frame.payload, _CRC.pack(crc)))


# crc32 of any bytes followed by their own crc32 (little-endian): a frame whose crc32 over all of it,
# crc field included, is this is intact (CRC-32's residue; zlib's and ISA-L's alike)
CRC_RESIDUE = 0x2144DF1C


def _read_tensor(r: _Reader, known: dict[int, tuple[int, int]] | None = None) -> TensorFrame:
    start = r.pos
    magic, version, flags, name_len, type_len, ndim, reserved, row_start, payload_len = r.unpack(
        _TENSOR_HEAD, "tensor frame header")
    _check_magic_version("tensor frame", magic, TENSOR_MAGIC, version, flags)
    if reserved != 0:
        raise MalformedFrame(f"tensor frame: reserved field is {reserved}, expected 0")
    if ndim > MAX_NDIM:
        raise MalformedFrame(f"tensor frame: ndim {ndim} > {MAX_NDIM}")
    try:
        name = bytes(r.take(name_len, "name")).decode("utf-8")
        ggml_type = bytes(r.take(type_len, "ggml_type")).decode("ascii")
    except UnicodeDecodeError as e:
        raise MalformedFrame(f"tensor frame: name or type is not text ({e.reason} at byte {e.start})") from None
    shape = tuple(r.unpack(_U64, f"shape[{i}]")[0] for i in range(ndim))
    meta_crc = crc32(r.span(start, r.pos))
    payload = r.take(payload_len, f"payload of {name}")
    (crc,) = r.unpack(_CRC, f"crc32 of {name}")
    whole = (known or {}).get(start)
    if whole is not None and whole[0] == r.pos - start:
        # The binding computed the crc32 of this whole frame as it copied it: no second pass. The
        # payload's is what the frame's crc32 leaves once the meta's is taken out (crc32 is linear:
        # crc(meta + payload) = combine(crc(meta), 0, len) ^ crc(payload)).
        if whole[1] != CRC_RESIDUE:
            raise ChecksumMismatch(f"tensor frame {name}: its {r.pos - start} bytes do not match its crc32 "
                                   f"0x{crc:08x} (checked as they were copied)")
        payload_crc = crc ^ crc32_combine(meta_crc, 0, payload_len)
    else:
        payload_crc = crc32(payload)
        got = crc32_combine(meta_crc, payload_crc, payload_len)  # = crc32 of every byte before the crc
        if got != crc:
            raise ChecksumMismatch(f"tensor frame {name}: crc32 0x{got:08x} over {payload_len} payload bytes, "
                                   f"frame says 0x{crc:08x}")
    # A view, not a copy: a fluid station decodes ~300 MB of frames per token. Whoever keeps a
    # payload beyond the request copies it (it pins the whole received buffer otherwise).
    return TensorFrame(name, ggml_type, shape, payload.toreadonly(), row_start, payload_crc)


def decode_tensor(buf: bytes | memoryview) -> TensorFrame:
    r = _Reader(buf, "tensor frame")
    frame = _read_tensor(r)
    if r.remaining():
        raise MalformedFrame(f"tensor frame {frame.name}: {r.remaining()} trailing bytes after the crc")
    return frame


# ---------------------------------------------------------------- batch


def encode_batch(frames: Iterable[TensorFrame]) -> bytes:
    return join_batch([encode_tensor(f) for f in frames])


def batch_parts(encoded: list[bytes]) -> list[bytes]:
    """A batch of frames already encoded by encode_tensor (a cache can keep them encoded: the
    crc32 is computed once, not per request), as the buffers it concatenates: the header, then
    each frame. A reply can send them without joining them (Response.from_parts)."""
    return [_BATCH_HEAD.pack(BATCH_MAGIC, VERSION, 0, 0, len(encoded)), *encoded]


def join_batch(encoded: list[bytes]) -> bytes:
    """batch_parts, joined into one buffer."""
    return b"".join(batch_parts(encoded))


def decode_batch(buf: bytes | memoryview | Sequence[bytes | memoryview],
                 known_crc32s: dict[int, tuple[int, int]] | None = None) -> list[TensorFrame]:
    """The batch's frames, from one buffer or the buffers it concatenates (Response.parts: a frame
    inside one part is a view of it, not a copy). known_crc32s (Response.body_crc32s): offset ->
    (length, crc32) of byte ranges this process's binding checked; a frame that is exactly one of
    them is not read again."""
    r = _Reader(buf, "tensor batch")
    magic, version, flags, reserved, count = r.unpack(_BATCH_HEAD, "batch header")
    _check_magic_version("tensor batch", magic, BATCH_MAGIC, version, flags)
    if reserved != 0:
        raise MalformedFrame(f"tensor batch: reserved field is {reserved}, expected 0")
    frames = []
    for i in range(count):
        r.what = f"tensor batch frame {i} of {count}"
        frames.append(_read_tensor(r, known_crc32s))
    if r.remaining():
        raise MalformedFrame(f"tensor batch: {r.remaining()} trailing bytes after {count} frames")
    return frames


# ---------------------------------------------------------------- array envelope (stations, shards)
# The hop envelope between coordinator, stations and shards (request id, position, sequence
# length, forward mode):
#
#     off  size  field
#     0    4     magic        b"KENV"
#     4    1     version      1
#     5    1     mode         0 prefill, 1 decode, 2 embed (shard), 3 logits (shard), 4 draft (drafter),
#                               5 sample (shard: a slice's sampling summary, common/shard_sampling.py)
#     6    1     dtype        0 float32, 1 int32, 2 float64
#     7    1     ndim         u8, dims of the array (<= MAX_NDIM)
#     8    4     position     u32, position of the first row of the array in its sequence
#     12   4     seq_len      u32, sequence length once this frame is applied (position + rows)
#     16   2     id_len       u16, bytes of the UTF-8 request id
#     18   2     flags        bit 0 REWIND (a station first drops the session's positions from
#                             `position` on: the rejected drafts of a speculative trip);
#                             bit 1 PREFIX (a prefill frame: the key of the tokens [0, position) follows
#                             the id); bit 2 BLOCK (the frame holds whole prompt blocks from `position`
#                             on: their count and the key of the tokens up to each block's end follow,
#                             a station may keep each block's KV under its key; common/prefix.py);
#                             others 0
#     20   ..    request_id   id_len bytes
#     ..   16    prefix       with PREFIX
#     ..   1     blocks       with BLOCK: u8 n >= 1, the whole blocks' count
#     ..   16*n  block keys   with BLOCK: key i names the tokens [0, position + (i + 1) * block)
#     ..   8*nd  shape        u64 each, C order (rows first): (T, dim) activations, (T,) tokens
#     ..   ..    payload      prod(shape) * itemsize bytes, little-endian
#     ..   4     crc32        CRC-32 (zlib's) of every byte above

ENVELOPE_MAGIC = b"KENV"
ENVELOPE_CONTENT_TYPE = "application/x-knot-envelope"
MODES = ("prefill", "decode", "embed", "logits", "draft", "sample")
DTYPES = ("<f4", "<i4", "<f8")  # index = dtype code
FLAG_REWIND = 1
FLAG_PREFIX = 2
FLAG_BLOCK = 4
_ENV_FLAGS = FLAG_REWIND | FLAG_PREFIX | FLAG_BLOCK  # every flag this decoder knows
PREFIX_KEY_BYTES = 16
_ENV_HEAD = struct.Struct("<4sBBBBIIHH")


@dataclass(frozen=True)
class Envelope:
    request_id: str
    mode: str  # one of MODES
    position: int
    seq_len: int
    array: np.ndarray  # float32 activations (T, dim) / logits, or int32 token ids (T,)
    rewind: bool = False  # stations: drop the session's positions >= position before applying
    prefix: bytes | None = None  # prefill: the key of the tokens before `position` (common/prefix.py)
    blocks: tuple[bytes, ...] = ()  # prefill: the keys of the whole blocks it holds from `position` on


def encode_envelope(env: Envelope) -> bytes:
    rid = env.request_id.encode("utf-8")
    arr = np.ascontiguousarray(env.array)
    dtype = arr.dtype.newbyteorder("<").str
    if dtype not in DTYPES:
        raise ValueError(f"envelope array dtype {arr.dtype} is not float32, int32 or float64")
    if env.mode not in MODES or len(rid) > 0xFFFF or arr.ndim > MAX_NDIM:
        raise ValueError(f"envelope: mode {env.mode!r}, id {len(rid)} B or ndim {arr.ndim} out of range")
    keys = [k for k in (env.prefix, *env.blocks) if k is not None]
    if any(len(k) != PREFIX_KEY_BYTES for k in keys) or len(env.blocks) > 0xFF:
        raise ValueError(f"envelope: prefix keys are {PREFIX_KEY_BYTES} bytes, at most 255 blocks, "
                         f"got {[len(k) for k in keys]}")
    flags = ((FLAG_REWIND if env.rewind else 0) | (FLAG_PREFIX if env.prefix is not None else 0) |
             (FLAG_BLOCK if env.blocks else 0))
    head = _ENV_HEAD.pack(ENVELOPE_MAGIC, VERSION, MODES.index(env.mode), DTYPES.index(dtype), arr.ndim,
                          env.position, env.seq_len, len(rid), flags)
    keys_bytes = (env.prefix or b"") + (bytes([len(env.blocks)]) + b"".join(env.blocks) if env.blocks else b"")
    meta = head + rid + keys_bytes + b"".join(_U64.pack(d) for d in arr.shape)
    payload = arr.astype(dtype, copy=False).tobytes()
    return b"".join((meta, payload, _CRC.pack(crc32(payload, crc32(meta)))))


def encode_envelopes(envs: Iterable[Envelope]) -> bytes:
    """Several envelopes back to back (a reply that carries more than one array)."""
    return b"".join(encode_envelope(e) for e in envs)


def decode_envelopes(buf: bytes | memoryview) -> list[Envelope]:
    """The envelopes of encode_envelopes, in order; at least one, and nothing after the last."""
    r = _Reader(buf, "envelope")
    out = [_read_envelope(r)]
    while r.remaining():
        out.append(_read_envelope(r))
    return out


def decode_envelope(buf: bytes | memoryview) -> Envelope:
    r = _Reader(buf, "envelope")
    env = _read_envelope(r)
    if r.remaining():
        raise MalformedFrame(f"envelope {env.request_id}: {r.remaining()} trailing bytes after the crc")
    return env


def _read_envelope(r: _Reader) -> Envelope:
    start = r.pos
    magic, version, mode, dtype, ndim, position, seq_len, id_len, flags = r.unpack(_ENV_HEAD, "envelope header")
    _check_magic_version("envelope", magic, ENVELOPE_MAGIC, version, 0)
    if mode >= len(MODES) or dtype >= len(DTYPES) or ndim > MAX_NDIM or flags & ~_ENV_FLAGS:
        raise MalformedFrame(f"envelope: mode {mode}, dtype {dtype}, ndim {ndim}, flags 0x{flags:04x} "
                             f"(modes 0..{len(MODES) - 1}, dtypes 0..{len(DTYPES) - 1}, ndim <= {MAX_NDIM}, "
                             f"flags 0x{_ENV_FLAGS:04x})")
    try:
        rid = bytes(r.take(id_len, "request_id")).decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedFrame(f"envelope: request id is not UTF-8 (byte {e.start})") from None
    prefix = bytes(r.take(PREFIX_KEY_BYTES, "prefix key")) if flags & FLAG_PREFIX else None
    blocks: tuple[bytes, ...] = ()
    if flags & FLAG_BLOCK:
        n_blocks = bytes(r.take(1, "block count"))[0]
        if n_blocks == 0:
            raise MalformedFrame(f"envelope {rid}: flag BLOCK with no block key")
        raw = bytes(r.take(n_blocks * PREFIX_KEY_BYTES, "block keys"))
        blocks = tuple(raw[i:i + PREFIX_KEY_BYTES] for i in range(0, len(raw), PREFIX_KEY_BYTES))
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    shape = tuple(r.unpack(_U64, f"shape[{i}]")[0] for i in range(ndim))
    # A hostile shape such as (0, 2**63) claims no payload yet no array can take it: every
    # dimension must be >= 1 and the product must fit the bytes that are actually there.
    if ndim == 0 or 0 in shape:
        raise MalformedFrame(f"envelope {rid}: shape {shape} holds no element (every dimension must be >= 1)")
    n = 1
    for d in shape:
        n *= d
        if n * itemsize > r.remaining():
            raise TruncatedFrame(f"envelope {rid}: shape {shape} needs at least {n * itemsize} payload bytes, "
                                 f"only {r.remaining()} left")
    payload = r.take(n * itemsize, f"payload {shape}")
    (crc,) = r.unpack(_CRC, "crc32")
    got = crc32(r.span(start, r.pos - _CRC.size))
    if got != crc:
        raise ChecksumMismatch(f"envelope {rid}: crc32 0x{got:08x}, frame says 0x{crc:08x}")
    if seq_len < position:
        raise MalformedFrame(f"envelope {rid}: seq_len {seq_len} < position {position}")
    arr = np.frombuffer(payload, dtype=DTYPES[dtype]).reshape(shape)
    return Envelope(rid, MODES[mode], position, seq_len, arr, bool(flags & FLAG_REWIND), prefix, blocks)


# ---------------------------------------------------------------- sampling spec (shard-side sampling)
# POST /sample on a shard: this frame, then a "logits" envelope of the final normed hidden (T, dim).
# It says what the sampler needs from the slice of each row (common/shard_sampling.py):
#
#     off  size  field
#     0    4     magic          b"KSMP"
#     4    1     version        1
#     5    1     flags          bit 0 DRAW: also the slice's best Gumbel-perturbed score (temperature > 0,
#                               no top-k / top-p / min-p: every token of the slice may be drawn);
#                               bit 1 NO_LSE: the sampler needs no log-sum-exp (no top-p, no logprobs),
#                               so the slice's LSE column is NaN, not computed; others 0
#     6    2     reserved       0
#     8    4     top            u32, candidates per row (>= 1): the slice's best logits and their ids
#     12   4     penalty_last_n i32, the penalty window (0 off, -1 all), as SamplingParams
#     16   8     temperature    f64
#     24   8     key            u64, the sampler's noise key (the seed)
#     32   8     repetition     f64, repetition_penalty
#     40   8     frequency      f64, frequency_penalty
#     48   8     presence       f64, presence_penalty
#     56   4     n_history      u32, tokens that follow
#     60   4*n   history        i32 each: the sequence's last tokens up to the last row's input token
#                               (row j of T sees history[:n - (T - 1 - j)]: the penalties' window)
#     ..   4     crc32          CRC-32 (zlib's) of every byte above

SAMPLE_MAGIC = b"KSMP"
SAMPLE_CONTENT_TYPE = "application/x-knot-sample"
FLAG_DRAW = 1
FLAG_NO_LSE = 2
MAX_SAMPLE_TOP = 4096  # candidates per row a shard may be asked for
_SAMPLE_HEAD = struct.Struct("<4sBBHIidQdddI")


@dataclass(frozen=True)
class SampleSpec:
    top: int
    temperature: float
    key: int
    draw: bool = False
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    penalty_last_n: int = 0
    history: tuple[int, ...] = ()
    lse: bool = True  # False: NO_LSE, the slices' log-sum-exps are not needed (nor computed)


def encode_sample_request(spec: SampleSpec, env: Envelope) -> bytes:
    """The body of POST /sample: the spec frame, then the envelope."""
    if not 1 <= spec.top <= MAX_SAMPLE_TOP or not -1 <= spec.penalty_last_n < 2 ** 31:
        raise ValueError(f"sample spec: top {spec.top} or penalty_last_n {spec.penalty_last_n} out of range")
    hist = np.asarray(spec.history, dtype="<i4").tobytes()
    flags = (FLAG_DRAW if spec.draw else 0) | (0 if spec.lse else FLAG_NO_LSE)
    head = _SAMPLE_HEAD.pack(SAMPLE_MAGIC, VERSION, flags, 0, spec.top, spec.penalty_last_n,
                             spec.temperature, spec.key & 0xFFFFFFFFFFFFFFFF, spec.repetition, spec.frequency,
                             spec.presence, len(spec.history))
    return head + hist + _CRC.pack(crc32(hist, crc32(head))) + encode_envelope(env)


def decode_sample_request(buf: bytes | memoryview) -> tuple[SampleSpec, Envelope]:
    r = _Reader(buf, "sample spec")
    (magic, version, flags, reserved, top, last_n, temperature, key, repetition, frequency, presence,
     n_hist) = r.unpack(_SAMPLE_HEAD, "sample spec header")
    _check_magic_version("sample spec", magic, SAMPLE_MAGIC, version, flags & ~(FLAG_DRAW | FLAG_NO_LSE))
    if reserved or not 1 <= top <= MAX_SAMPLE_TOP or last_n < -1:
        raise MalformedFrame(f"sample spec: reserved {reserved}, top {top} (1..{MAX_SAMPLE_TOP}) or "
                             f"penalty_last_n {last_n} (>= -1) out of range")
    # What SamplingParams and the sampler accept; NaN fails every comparison, so it is refused too.
    if not (0 <= temperature < float("inf") and 0 < repetition < float("inf")
            and abs(frequency) < float("inf") and abs(presence) < float("inf")):
        raise MalformedFrame(f"sample spec: temperature {temperature}, repetition {repetition}, "
                             f"frequency {frequency} or presence {presence} is not a valid finite value")
    if flags & FLAG_DRAW and temperature == 0:
        raise MalformedFrame("sample spec: DRAW with temperature 0 (greedy draws nothing)")
    hist = np.frombuffer(r.take(4 * n_hist, f"history ({n_hist} tokens)"), dtype="<i4")
    (crc,) = r.unpack(_CRC, "crc32")
    got = crc32(r.span(0, r.pos - _CRC.size))
    if got != crc:
        raise ChecksumMismatch(f"sample spec: crc32 0x{got:08x}, frame says 0x{crc:08x}")
    env = _read_envelope(r)
    if r.remaining():
        raise MalformedFrame(f"sample request: {r.remaining()} trailing bytes after the envelope")
    spec = SampleSpec(top, temperature, key, bool(flags & FLAG_DRAW), repetition, frequency, presence, last_n,
                      tuple(hist.tolist()), not flags & FLAG_NO_LSE)
    return spec, env


# ---------------------------------------------------------------- warden requests (what to send)
# The bodies of POST /tensors on the hot path, binary so no JSON is parsed per phase or row:
#
#     LayerWarden       NAMES_CONTENT_TYPE   tensor names, UTF-8, one per line
#     CobordismWarden   ROWS_CONTENT_TYPE    row ids, int32 little-endian, back to back
#
# Both wardens still take their JSON forms ({"names": [...]}, {"rows": [...]}) for curl and tools.

NAMES_CONTENT_TYPE = "text/plain; charset=utf-8"
ROWS_CONTENT_TYPE = "application/x-knot-rows"


def encode_names(names: Iterable[str]) -> bytes:
    names = list(names)
    bad = [n for n in names if not n or "\n" in n]
    if bad:
        raise ValueError(f"tensor names must be non-empty and hold no newline: {bad[:3]!r}")
    return "\n".join(names).encode("utf-8")


def decode_names(body: bytes) -> list[str]:
    try:
        names = body.decode("utf-8").split("\n") if body else []
    except UnicodeDecodeError as e:
        raise MalformedFrame(f"tensor names: not UTF-8 ({e.reason} at byte {e.start})") from None
    if not names or any(not n for n in names):
        raise MalformedFrame("tensor names: expected one non-empty name per line")
    return names


def encode_rows(rows: Iterable[int]) -> bytes:
    return np.asarray(list(rows), dtype="<i4").tobytes()


def decode_rows(body: bytes) -> list[int]:
    if not body or len(body) % 4:
        raise MalformedFrame(f"row ids: {len(body)} bytes, expected a non-zero multiple of 4 (int32 each)")
    return np.frombuffer(body, dtype="<i4").tolist()


# ---------------------------------------------------------------- bundles (continuous batching)
# POST /forward_many (a station) and POST /sample_many (a shard) carry the bodies of several single
# calls (/forward, /sample) in one request, and their replies in one reply, so the decode steps of
# concurrent generations cross each hop as one call (services/coordinator/pipeline.py):
#
#     off  size  field
#     0    4     magic      b"KBDL"
#     4    1     version    1
#     5    1     flags      0
#     6    2     count      u16, 1..MAX_BUNDLE parts
#     8    6*n   table      per part: u16 status, u32 length (a request's statuses are 0; a reply's are
#                           the HTTP status of that part's single call: 200 and its reply body, or the
#                           error's status and its JSON body {"error", "message"})
#     ..   4     crc32      CRC-32 of the bytes above (each part's body carries its own check)
#     ..   ..    parts      the bodies back to back, nothing after them

BUNDLE_MAGIC = b"KBDL"
BUNDLE_CONTENT_TYPE = "application/x-knot-bundle"
MAX_BUNDLE = 64  # parts a bundle may hold: a coordinator runs far fewer generations at once
_BUNDLE_HEAD = struct.Struct("<4sBBH")
_BUNDLE_PART = struct.Struct("<HI")


def encode_bundle(parts: Iterable[tuple[int, bytes]]) -> bytes:
    """(status, body) per part -> one body."""
    parts = list(parts)
    if not 1 <= len(parts) <= MAX_BUNDLE:
        raise ValueError(f"bundle: {len(parts)} parts, expected 1..{MAX_BUNDLE}")
    head = _BUNDLE_HEAD.pack(BUNDLE_MAGIC, VERSION, 0, len(parts)) + \
        b"".join(_BUNDLE_PART.pack(status, len(body)) for status, body in parts)
    return b"".join((head, _CRC.pack(crc32(head)), *(body for _, body in parts)))


def decode_bundle(buf: bytes | memoryview) -> list[tuple[int, memoryview]]:
    """A bundle's parts, (status, body) in order; WireError when it is not exactly one bundle."""
    r = _Reader(buf, "bundle")
    magic, version, flags, count = r.unpack(_BUNDLE_HEAD, "bundle header")
    _check_magic_version("bundle", magic, BUNDLE_MAGIC, version, flags)
    if not 1 <= count <= MAX_BUNDLE:
        raise MalformedFrame(f"bundle: {count} parts, expected 1..{MAX_BUNDLE}")
    table = [r.unpack(_BUNDLE_PART, f"part {i}'s status and length") for i in range(count)]
    (crc,) = r.unpack(_CRC, "crc32")
    got = crc32(r.span(0, r.pos - _CRC.size))
    if got != crc:
        raise ChecksumMismatch(f"bundle: crc32 0x{got:08x}, frame says 0x{crc:08x}")
    parts = [(status, r.take(n, f"part {i} ({n} bytes)")) for i, (status, n) in enumerate(table)]
    if r.remaining():
        raise MalformedFrame(f"bundle: {r.remaining()} trailing bytes after its {count} parts")
    return parts
