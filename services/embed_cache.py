"""The L2 tier for embedding rows (seed section 4): dequantized float32 rows in KV, 24 h TTL.

Used by the CobordismWarden: on a RAM miss it asks KV before R2 (the shards reach KV through their
warden, and keep their own small row LRU in front of it). Each value carries where it came
from and what it held, and is checked before use:

    KV value, version 2 (integers little-endian):
    off  size      field
    0    4         magic      b"KROW"
    4    1         version    2
    5    1         etag_len   bytes of the etag
    6    2         reserved   0
    8    4         row        u32, the row id the value is for
    12   4         crc32      zlib.crc32 of the payload
    16   32        mac        HMAC-SHA256 under the cluster's secret (common/integrity.py CacheKey)
                              of (KV_TAG, etag, the value's KV key, payload bytes, payload)
    48   etag_len  etag       UTF-8: the knot version the row was read at
    ..   4*hidden  payload    float32 (hidden,)

Keys are "embed:{knot_key}@{etag}:{row}", so a replaced knot never even looks up the old rows.
A value that is malformed, of another version or row, of the wrong length, whose payload
disagrees with its crc32 (corrupt) or whose MAC does not verify (written without the cluster's
secret: forged, or another cluster's) is a miss ("poisoned": counted, logged, deleted in the
background, and rewritten from R2 after the delete). Seed section 8 traps handled here:
- kvGet silent cache poisoning: a value of the wrong length, and of the right length but the
  wrong content, is a miss;
- missing ctx.waitUntil on KV writes: every write and delete goes through wait_until.
A KV that cannot be reached degrades to a miss (logged): the cache must never fail a request.
Whoever can write the KV (the Redis password) but not the secret can delete rows, which costs a
read from R2, but cannot make one that is served. Without a secret (a host started by hand) the
warden does not use KV at all (services/cobordism_warden/cobordism_warden.py).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import struct
import uuid
from typing import Any, Awaitable, Callable

import numpy as np

from common.integrity import MAC_BYTES, CacheKey, Seal, crc32
from common.lru import ByteLRU
from common.runtime import HttpError, KVNamespace

log = logging.getLogger(__name__)

TTL_S = 24 * 3600
KEY_PREFIX = "embed"
VALUE_MAGIC = b"KROW"
VALUE_VERSION = 2
_VALUE_HEAD = struct.Struct(f"<4sBBHII{MAC_BYTES}s")  # magic version etag_len reserved row crc32 mac
KV_TAG = b"kv-row"  # the domain of a KV value's MAC
KEPT_TAG = b"kept-row"  # the domain of a SealedRows entry's MAC


def process_key() -> CacheKey:
    """A key only this process holds (two uuid4s: os.urandom's 244 bits), for caches in its own
    memory: whoever can write that memory can read any key in it, the cluster's secret included."""
    return CacheKey(uuid.uuid4().hex + uuid.uuid4().hex, shared=False)


def cluster_key(secret: str | None) -> CacheKey | None:
    """The key of values other processes read (KV), from the cluster's KNOT_INTERNAL_SECRET; None without one."""
    return CacheKey(secret) if secret else None


class SealedRows(ByteLRU[int, tuple[Seal, np.ndarray]]):
    """Float32 embedding rows kept in this isolate (a shard's LRU in front of its warden, the
    coordinator's in front of the shards): row -> (seal, (dim,) read-only row), each sealed with the
    knot version and a MAC of its content (CacheKey), checked on every hit (~3.5 KB at 0.5B, ~14 KB
    at 7B). A row whose seal fails is a miss: counted in `rejects`, logged, dropped."""

    def __init__(self, budget_bytes: int, owner: str = "row cache", key: CacheKey | None = None):
        super().__init__(budget_bytes)
        self.key = key or process_key()  # rows in this process's memory
        self.owner = owner  # who keeps them, for the log
        self.rejects = 0

    def checked(self, row: int, etag: str) -> np.ndarray | None:
        """The kept row if its seal holds at version etag; else None (a miss)."""
        hit = self.get(row)
        if hit is None:
            return None
        s, vec = hit
        problem = self.key.problem(s, KEPT_TAG, str(row), etag, vec)
        if problem is None:
            return vec
        self.rejects += 1
        log.warning("%s row cache entry %d rejected (%s): refetching", self.owner, row, problem)
        self.pop(row)
        return None

    def keep(self, row: int, vec: np.ndarray, etag: str) -> None:
        """Keep vec as it is, made read-only (later lookups share it): pass a copy if it views a larger buffer."""
        vec.flags.writeable = False
        self.put(row, (self.key.seal(KEPT_TAG, str(row), etag, vec), vec), vec.nbytes)


def row_key(namespace: str, row: int) -> str:
    """namespace = "{knot_key}@{etag}": a re-uploaded knot never reads the old knot's rows."""
    return f"{KEY_PREFIX}:{namespace}:{row}"


def encode_row(key: CacheKey, kv_key: str, etag: str, row: int, vec: np.ndarray) -> bytes:
    """One KV value, to be stored under kv_key: the layout above; vec is float32 (hidden,)."""
    tag = etag.encode("utf-8")
    assert len(tag) <= 0xFF, f"etag of {len(tag)} bytes does not fit etag_len"
    payload = np.ascontiguousarray(vec, dtype="<f4").tobytes()
    mac = key.content_mac(KV_TAG, etag, kv_key, payload)
    return _VALUE_HEAD.pack(VALUE_MAGIC, VALUE_VERSION, len(tag), 0, row, crc32(payload), mac) + tag + payload


def decode_row(key: CacheKey, kv_key: str, value: bytes, etag: str, row: int, hidden: int) -> np.ndarray | str:
    """The float32 (hidden,) row a value read from kv_key holds, or what is wrong with it (a str)
    when it is not exactly row `row` of knot version `etag`, intact, written with the cluster's key."""
    if len(value) < _VALUE_HEAD.size:
        return f"{len(value)} bytes, shorter than the {_VALUE_HEAD.size}-byte value header"
    magic, version, etag_len, reserved, got_row, crc, mac = _VALUE_HEAD.unpack_from(value)
    if magic != VALUE_MAGIC or version != VALUE_VERSION or reserved:
        return f"magic {magic!r} version {version}, expected {VALUE_MAGIC!r} version {VALUE_VERSION}"
    tag = value[_VALUE_HEAD.size:_VALUE_HEAD.size + etag_len]
    if tag != etag.encode("utf-8"):
        return f"knot version {tag!r}, expected {etag!r}"
    if got_row != row:
        return f"holds row {got_row}, expected {row}"
    payload = memoryview(value)[_VALUE_HEAD.size + etag_len:]
    if len(payload) != hidden * 4:
        return f"payload of {len(payload)} bytes, expected hidden {hidden} * 4 = {hidden * 4}"
    got = crc32(payload)
    if got != crc:
        return f"payload crc32 0x{got:08x}, the value says 0x{crc:08x}"
    if not hmac.compare_digest(key.content_mac(KV_TAG, etag, kv_key, payload), mac):
        return "its MAC does not verify under the cluster's secret: not written by this cluster"
    return np.frombuffer(payload, dtype="<f4")


class EmbedRowCache:
    def __init__(self, kv: KVNamespace, key: CacheKey, knot_key: str, etag: str, hidden: int,
                 wait_until: Callable[[Awaitable[Any]], None], ttl_s: int = TTL_S):
        assert key.shared, "KV is shared with other processes: its values need the cluster's key"
        self.kv, self.mac_key, self.etag, self.hidden = kv, key, etag, hidden
        self.namespace = f"{knot_key}@{etag}"
        self.wait_until, self.ttl_s = wait_until, ttl_s
        self.hits = self.misses = self.poisoned = self.errors = self.writes = 0
        self._deleting: dict[str, asyncio.Future] = {}

    def key(self, row: int) -> str:
        return row_key(self.namespace, row)

    async def _get(self, row: int) -> bytes | None:
        try:
            return await self.kv.get(self.key(row))
        except HttpError as e:  # ServiceUnavailable / GatewayTimeout from the binding
            self.errors += 1
            log.warning("KV get %s failed, treating as a miss: %s", self.key(row), e)
            return None

    async def get_rows(self, rows: list[int]) -> dict[int, np.ndarray]:
        """Rows found, and intact, in KV: row -> float32 (hidden,)."""
        values = await asyncio.gather(*(self._get(r) for r in rows))
        out: dict[int, np.ndarray] = {}
        for row, value in zip(rows, values):
            got = None if value is None else decode_row(self.mac_key, self.key(row), value, self.etag, row, self.hidden)
            if got is None:
                self.misses += 1
            elif isinstance(got, str):
                self.misses += 1
                self.poisoned += 1
                key = self.key(row)
                log.warning("KV row %s rejected (%s): poisoned, deleting and refetching from R2", key, got)
                task = asyncio.ensure_future(self.kv.delete(key))
                self._deleting[key] = task
                self.wait_until(task)
            else:
                self.hits += 1
                out[row] = got
        return out

    def put_rows(self, row_start: int, rows_f32: np.ndarray) -> None:
        """Write rows [row_start, row_start + n) in the background (after any pending delete of a key)."""
        assert rows_f32.ndim == 2 and rows_f32.shape[1] == self.hidden, f"{rows_f32.shape=} {self.hidden=}"
        for i, vec in enumerate(rows_f32):
            key = self.key(row_start + i)
            value = encode_row(self.mac_key, key, self.etag, row_start + i, vec)
            self.wait_until(self._write(key, value, self._deleting.pop(key, None)))

    async def _write(self, key: str, value: bytes, after: asyncio.Future | None) -> None:
        if after is not None:
            await asyncio.wait([after])  # the delete of the poisoned value lands first
        await self.kv.put(key, value, expiration_ttl=self.ttl_s)
        self.writes += 1

    def stats(self) -> dict[str, int]:
        return {"kv_hits": self.hits, "kv_misses": self.misses, "kv_poisoned": self.poisoned,
                "kv_errors": self.errors, "kv_writes": self.writes}
