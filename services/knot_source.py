"""The knot in the bucket, pinned to one version: counted ranged reads, the header read once.

A service boots on the version (etag) that head() reports and every later read asks for exactly
that version (Bucket.get if_match: S3 If-Match, R2 onlyIf). When the object was replaced, the
read raises KnotChanged (503): the request is refused rather than computed from two versions,
and the source is marked `changed`, so the next request reloads the service on the new version
through its BootCache (serving_version below).

Every hop between services names the version it works on in the X-Knot-Etag header, both ways:
a service asked for another version than it serves checks the bucket, reloads when the bucket
moved on, and otherwise refuses with KnotVersionMismatch (503, its own version in the header).
So a forward that started on version A never uses a byte of version B (docs/runtime.md).
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable, NoReturn, TypeVar

from common.knot import CorruptKnot, KnotError, KnotHeader, read_header
from common.models import Model, model_for
from common.runtime import HttpError, NotFound, PreconditionFailed, ServiceUnavailable
from services.boot import BootCache

log = logging.getLogger(__name__)

KNOT_ETAG_HEADER = "X-Knot-Etag"  # the knot version a request works on, and a reply was computed from


class KnotChanged(ServiceUnavailable):
    """The knot in the bucket is no longer the version this service serves."""


class KnotVersionMismatch(ServiceUnavailable):
    """The caller works on another knot version than this service serves."""


class KnotCorrupt(ServiceUnavailable):
    """Bytes read from the bucket disagree with the knot header's crc32 for them."""


# Error names (the "error" of a reply body) that fail a whole request: never degraded around.
INTEGRITY_ERRORS = frozenset({KnotChanged.__name__, KnotVersionMismatch.__name__, KnotCorrupt.__name__})


class KnotSource:
    def __init__(self, bucket, knot_key: str):
        self.bucket, self.knot_key = bucket, knot_key
        self.etag = ""
        self.size = 0
        self.changed = False  # a read found another version in the bucket: reload before serving again
        self.reads = 0
        self.bytes_read = 0
        self.header_bytes_read = 0
        self.corrupt_reads = 0
        self._header: KnotHeader | None = None

    async def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the knot at the booted version: one HTTP Range request (If-Match)."""
        try:
            obj = await self.bucket.get(self.knot_key, range=(start, end), if_match=self.etag or None)
        except PreconditionFailed as e:
            self._changed(str(e))
        if obj is None:
            self._changed("the object is gone from the bucket")
        if self.etag and obj.etag != self.etag:  # a binding that ignored if_match
            self._changed(f"the bucket answered with version {obj.etag!r}")
        self.reads += 1
        self.bytes_read += len(obj.body)
        return obj.body

    def _changed(self, detail: str) -> NoReturn:
        self.changed = True
        log.warning("knot %s changed in the bucket (was version %s): %s", self.knot_key, self.etag, detail)
        raise KnotChanged(f"knot {self.knot_key!r} changed in the bucket since this service loaded version "
                          f"{self.etag!r} ({detail}); the request is refused so that nothing mixes two versions, "
                          f"and the next one loads the new version", headers={KNOT_ETAG_HEADER: self.etag})

    async def read_tensor(self, name: str) -> bytes:
        """A whole tensor (or blob), checked against the header's crc32 when the knot carries one."""
        header = await self.header()
        data = await self.read(*(header.tensor_range(name) if name in header.tensors else header.blob_range(name)))
        self.verify(name, data)
        return data

    def verify(self, name: str, data: bytes | memoryview | None = None, *, crc: int | None = None,
               nbytes: int | None = None) -> bool:
        """Check bytes (or their crc32 and length) against the header: True when checked, False when the
        knot has no checksum for `name`; KnotCorrupt (503) on a mismatch."""
        assert self._header is not None, "verify() before header()"
        try:
            if data is not None:
                return self._header.verify(name, data)
            assert crc is not None and nbytes is not None
            return self._header.verify_crc(name, crc, nbytes)
        except CorruptKnot as e:
            self.corrupt_reads += 1
            log.error("knot %s version %s: %s", self.knot_key, self.etag, e)
            raise KnotCorrupt(f"knot {self.knot_key!r} version {self.etag!r}: {e}") from None

    async def header(self) -> KnotHeader:
        """Parse the header (probe + second fetch if needed) and run the stale-knot size guard."""
        if self._header is None:
            meta = await self.bucket.head(self.knot_key)
            if meta is None:
                raise NotFound(f"knot {self.knot_key!r} is not in the bucket; upload it or fix knot_key")
            self.etag, self.size = meta.etag, meta.size  # the version every later read is pinned to

            async def read_range(start: int, end: int) -> bytes:
                # The reader probes a fixed size; a small knot is shorter than the probe.
                data = await self.read(start, min(end, meta.size))
                self.header_bytes_read += len(data)
                return data

            try:
                self._header = await read_header(read_range, file_size=meta.size)
            except KnotError as e:  # shrunk, not a knot, stale: the service cannot run it (503, not 500)
                raise KnotCorrupt(f"knot {self.knot_key!r} version {self.etag!r} cannot be read: {type(e).__name__}: "
                                  f"{e}; re-encode it (`knot encode`) and upload it again") from None
        return self._header

    async def model(self) -> Model:
        """The header's architecture from the model registry; one it lacks (or inconsistent hparams)
        is a 503 that names it: this service cannot run that knot."""
        header = await self.header()
        try:
            return model_for(header)
        except ValueError as e:
            raise ServiceUnavailable(f"knot {self.knot_key!r}: {e}") from None

    async def bucket_etag(self) -> str | None:
        """The version the bucket holds now (one head()), None when the object is gone."""
        meta = await self.bucket.head(self.knot_key)
        return None if meta is None else meta.etag

    def stats(self) -> dict[str, int | str]:
        return {"knot_etag": self.etag, "r2_reads": self.reads, "r2_bytes_read": self.bytes_read,
                "r2_header_bytes_read": self.header_bytes_read, "r2_corrupt_reads": self.corrupt_reads}


T = TypeVar("T")


async def serving_version(cache: BootCache[T], key: str, boot: Callable[[], Awaitable[T]],
                          source_of: Callable[[T], KnotSource], want: str | None = None,
                          check_bucket: bool = False) -> T:
    """The booted value for `key` that serves the knot version `want` (the caller's X-Knot-Etag).

    Reloads (boots again, replacing the cached value; requests in flight keep theirs) when a read
    found the knot replaced, when the caller works on another version than ours and the bucket moved
    on, or, with check_bucket, whenever the bucket holds another version. Raises
    KnotVersionMismatch when the caller's version is not the one the bucket holds.
    """
    value = await cache.get(key, boot)
    src = source_of(value)
    if not (src.changed or check_bucket or (want and want != src.etag)):
        return value
    try:
        current = await src.bucket_etag()
    except HttpError as e:  # the bucket is unreachable: our pinned version is still consistent
        if src.changed or (want and want != src.etag):
            raise
        log.warning("knot %s: cannot check the bucket's version, serving the loaded %s: %s", src.knot_key,
                    src.etag, e)
        return value
    if current is None:
        src.changed = True
        raise KnotChanged(f"knot {src.knot_key!r} is gone from the bucket (this service loaded version "
                          f"{src.etag!r})", headers={KNOT_ETAG_HEADER: src.etag})
    if current != src.etag:
        log.warning("knot %s: version %s -> %s in the bucket, reloading", src.knot_key, src.etag, current)
        value = await cache.get(key, boot, stale=lambda v: source_of(v).etag != current)
        src = source_of(value)
    else:
        src.changed = False  # the same version is back (S3 etags of equal bytes are equal)
    if want and want != src.etag:
        raise KnotVersionMismatch(f"the request works on knot version {want!r} of {src.knot_key!r}; this service "
                                  f"serves {src.etag!r}, the version the bucket holds",
                                  headers={KNOT_ETAG_HEADER: src.etag})
    return value
