"""Checksums of weight bytes, and the seal every cached copy of them carries. Pure (stdlib; isal where it imports).

One checksum everywhere: CRC-32 (zlib's, the IEEE polynomial). The knot's per-tensor checksums,
the tensor frames and envelopes of common/wire.py and the seals of the caches all use it, through
`crc32` below, the one place the implementation is chosen: ISA-L's (the `isal` package,
PCLMUL-folded, about ten times zlib's speed: benchmarks/fluid_copy.py) where it imports, zlib's otherwise. Both
compute the same values, so nothing stored or sent depends on which ran; Pyodide (Cloudflare's
Python Workers) has no isal and takes zlib's. It detects corruption and stale or misfiled entries, not a
forger: an attacker who can write a cache can also write a matching CRC. What a forger cannot do
is change the knot header the services pinned at boot, which is why a reader checks bytes against
the knot's own checksum wherever it has one (docs/knot-format.md, "Checksums").

A seal is where cached bytes came from: the object version (etag) they were read at and the CRC
of their content. A cache returns a hit only when both match; anything else is a miss.

A keyed seal (CacheKey) adds what a forger cannot compute: an HMAC-SHA256, under a key derived
from the cluster's internal secret (KNOT_INTERNAL_SECRET), over a domain tag, the knot version, the
entry's name, its length and either its content (KV rows, embedding rows: small) or its crc32 (the
LayerWarden's frames, tens of MB a token: docs/reliability.md, "Keyed caches", says what that leaves
open). A writer without the secret cannot make an entry that passes.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

try:
    # crc32(data, value=0) -> int, zlib's signature and values; a fluid station checks every
    # streamed byte with it, ~2 GB per forward at the seed's 7B shape (issue 15)
    from isal.isal_zlib import crc32
except ImportError:  # Pyodide, or a platform without isal's wheels
    from zlib import crc32

_POLY = 0xEDB88320  # CRC-32 polynomial, reflected


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo p(x), reflected bit order. ref: zlib 1.2.12 crc32.c multmodp."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    """x^(2^k) mod p(x) for k = 0..31. ref: zlib crc32.c x2n_table."""
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(a + b) from crc1 = crc32(a), crc2 = crc32(b) and len2 = len(b) bytes, without the bytes.
    ref: zlib 1.2.12 crc32.c crc32_combine64 / x2nmodp (log2(len2) polynomial products)."""
    p, k, n = 1 << 31, 3, len2  # x^(8 * len2): 2^3 bits per byte
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ (crc2 & 0xFFFFFFFF)


@dataclass(frozen=True)
class Seal:
    """Where a cached copy of weight bytes came from, and what its content was."""

    etag: str  # version of the knot object the bytes were read at
    crc32: int  # of the bytes, as they were when sealed
    nbytes: int
    mac: bytes = b""  # CacheKey's HMAC-SHA256 of the seal (or of the content); b"": an unkeyed seal

    def problem(self, etag: str, data: bytes | memoryview) -> str | None:  # data: any contiguous buffer
        """None when `data` is what was sealed, at version `etag`; else what is wrong with it."""
        if self.etag != etag:
            return f"sealed at knot version {self.etag!r}, this service serves {etag!r}"
        nbytes = memoryview(data).nbytes
        if nbytes != self.nbytes:
            return f"{nbytes} bytes, sealed with {self.nbytes}"
        got = crc32(data)
        if got != self.crc32:
            return f"crc32 0x{got:08x} over {self.nbytes} bytes, sealed with 0x{self.crc32:08x}"
        return None


def seal(etag: str, data: bytes | memoryview, crc: int | None = None) -> Seal:
    """Seal bytes (any contiguous buffer) read at version etag; pass crc when it is already known."""
    return Seal(etag, crc32(data) if crc is None else crc, memoryview(data).nbytes)


MAC_BYTES = 32  # HMAC-SHA256
_KEY_LABEL = b"knot-cluster cache MAC v1"  # the cache key is derived, not the signing key itself
_FIELD = struct.Struct("<H")  # each text field's length, before it
_LENGTHS = struct.Struct("<QI")  # nbytes u64 | crc32 u32 (a seal MAC), or nbytes u64 | 0 (a content MAC)


class CacheKey:
    """HMAC-SHA256 of cache entries under a secret: the cluster's (KNOT_INTERNAL_SECRET) or one process's.

    A MAC covers: the domain tag (which store), the knot version, the entry's name (a KV key, a
    tensor name and row), its length, and then either the content itself (a content MAC) or only
    the content's crc32 (a seal MAC, for entries too large to hash on every hit). shared: the
    cluster's secret, which every process holds; else a secret of one process (random, from its
    caller: services/embed_cache.py process_key), for caches in that process's memory only."""

    def __init__(self, secret: str, shared: bool = True):
        assert secret, "a cache key needs a secret"
        self.shared = shared
        key = hmac.new(secret.encode("utf-8"), _KEY_LABEL, hashlib.sha256).digest()
        # keyed once, copied per MAC: a copy skips hashing the key's two padded blocks on every row
        self._keyed = hmac.new(key, digestmod="sha256")

    def _start(self, tag: bytes, etag: str, name: str, nbytes: int, crc: int | None) -> "hmac.HMAC":
        e, n = etag.encode("utf-8"), name.encode("utf-8")
        form = b"C" if crc is None else b"S"  # content MAC, seal MAC: never the same message
        h = self._keyed.copy()
        h.update(b"".join((tag, b"\0", form, _FIELD.pack(len(e)), e, _FIELD.pack(len(n)), n,
                           _LENGTHS.pack(nbytes, crc or 0))))
        return h

    def content_mac(self, tag: bytes, etag: str, name: str, data) -> bytes:
        """The MAC of (tag, etag, name, length, content); data: any contiguous buffer."""
        h = self._start(tag, etag, name, memoryview(data).nbytes, None)
        h.update(data)
        return h.digest()

    def seal_mac(self, tag: bytes, etag: str, name: str, nbytes: int, crc: int) -> bytes:
        """The MAC of (tag, etag, name, length, crc32): no pass over the content."""
        return self._start(tag, etag, name, nbytes, crc).digest()

    def seal(self, tag: bytes, name: str, etag: str, data, crc: int | None = None, content: bool = True) -> Seal:
        """A keyed seal of data (any contiguous buffer) read at version etag, named name in its store:
        its MAC covers the content (content=True) or the crc32 (pass crc when it is known)."""
        crc = crc32(data) if crc is None else crc
        nbytes = memoryview(data).nbytes
        mac = self.content_mac(tag, etag, name, data) if content else self.seal_mac(tag, etag, name, nbytes, crc)
        return Seal(etag, crc, nbytes, mac)

    def problem(self, s: Seal, tag: bytes, name: str, etag: str, data) -> str | None:
        """None when s is this key's content seal of data, named name under tag, at version etag;
        else what is wrong (a pass over the bytes: for small entries)."""
        if s.etag != etag:
            return f"sealed at knot version {s.etag!r}, this service serves {etag!r}"
        nbytes = memoryview(data).nbytes
        if nbytes != s.nbytes:
            return f"{nbytes} bytes, sealed with {s.nbytes}"
        if not hmac.compare_digest(self.content_mac(tag, etag, name, data), s.mac):
            return _bad_mac(s, tag, name)
        return None

    def seal_problem(self, s: Seal, tag: bytes, name: str, etag: str) -> str | None:
        """None when s is this key's seal MAC (content=False) for name under tag, at version etag; else
        what is wrong. The bytes are not looked at: their caller checks them against s.crc32, or
        against the knot's own checksums."""
        if s.etag != etag:
            return f"sealed at knot version {s.etag!r}, this service serves {etag!r}"
        if not hmac.compare_digest(self.seal_mac(tag, etag, name, s.nbytes, s.crc32), s.mac):
            return _bad_mac(s, tag, name)
        return None


def _bad_mac(s: Seal, tag: bytes, name: str) -> str:
    return f"{'a wrong' if s.mac else 'no'} MAC ({tag.decode()} {name!r}, {s.nbytes} bytes): not sealed with this key"
