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

Which knot a version may be is pinned by its digest (SHA-256 of the header, which commits to every
chunk digest, so to every byte): KNOT_DIGEST, else the digest of the first version the service
loaded. A version with another digest is refused (KnotNotPinned, 503) and the service serves on the
version it had loaded; the operator moves the pin with `knot cluster reload` or KNOT_DIGEST.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, NoReturn, TypeVar

from common.knot import CorruptKnot, KnotError, KnotHeader, read_header
from common.models import Model, model_for
from common.runtime import HttpError, NotFound, PreconditionFailed, ServiceUnavailable
from common.settings import ConfigError, read
from services.boot import BootCache

log = logging.getLogger(__name__)

KNOT_ETAG_HEADER = "X-Knot-Etag"  # the knot version a request works on, and a reply was computed from


class KnotChanged(ServiceUnavailable):
    """The knot in the bucket is no longer the version this service serves."""


class KnotVersionMismatch(ServiceUnavailable):
    """The caller works on another knot version than this service serves."""


class KnotCorrupt(ServiceUnavailable):
    """Bytes read from the bucket disagree with the knot header's crc32 or chunk digests for them."""


class KnotNotPinned(ServiceUnavailable):
    """The knot in the bucket is not the one the service is pinned to (its digest differs)."""

    def __init__(self, message: str, *, digest: str, headers: dict[str, str] | None = None):
        super().__init__(message, headers=headers)
        self.digest = digest  # the refused knot's


# Error names (the "error" of a reply body) that fail a whole request: never degraded around.
INTEGRITY_ERRORS = frozenset({KnotChanged.__name__, KnotVersionMismatch.__name__, KnotCorrupt.__name__,
                              KnotNotPinned.__name__})
_DIGEST = re.compile(r"[0-9a-f]{64}")
_HOW_TO_REPIN = ("To serve the bucket's knot: `knot cluster reload` (or set KNOT_DIGEST to its digest and restart "
                 "the services); to keep this one, upload it again")


def read_pin(env: Any, reader: str) -> str:
    """KNOT_DIGEST: the digest the knot must have, "" when unset (the first version loaded is pinned)."""
    pin = read(env, "KNOT_DIGEST", reader) or ""
    if pin and not _DIGEST.fullmatch(pin):
        raise ConfigError(f"Config 'KNOT_DIGEST' must be 64 lowercase hex digits (the digest `knot inspect` "
                          f"prints), got {pin!r}", name="KNOT_DIGEST")
    return pin


class KnotSource:
    def __init__(self, bucket, knot_key: str, pin: str = ""):
        self.bucket, self.knot_key = bucket, knot_key
        self.pin = pin  # the digest the knot must have; "": any (the service's first load)
        # (version, digest, pin) of a version in the bucket that the pin refused: serving_version asks again
        # only when the bucket or the pin moves on
        self.refused: tuple[str, str, str] | None = None
        self.etag = ""
        self.size = 0
        self.changed = False  # a read found another version in the bucket: reload before serving again
        self.reads = 0
        self.bytes_read = 0
        self.header_bytes_read = 0
        self.corrupt_reads = 0
        self._header: KnotHeader | None = None
        self.bucket_check = BucketCheck()  # serving_version's checks of the bucket's version (check_bucket)

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
        then = "the next one loads the new version, if it has the digest this service is pinned to"
        if self.refused:
            then = (f"the bucket's version {self.refused[0]!r} has digest {self.refused[1]}, refused: this service "
                    f"is pinned to {self.digest}. {_HOW_TO_REPIN}")
        raise KnotChanged(f"knot {self.knot_key!r} changed in the bucket since this service loaded version "
                          f"{self.etag!r} ({detail}); the request is refused so that nothing mixes two versions, "
                          f"and {then}", headers={KNOT_ETAG_HEADER: self.etag})

    @property
    def digest(self) -> str:
        """The loaded knot's digest ("" before header())."""
        return "" if self._header is None else self._header.digest

    async def read_tensor(self, name: str) -> bytes:
        """A whole tensor (or blob), checked against the header's crc32 and every chunk digest."""
        header = await self.header()
        data = await self.read(*header.entry_range(name))
        self.verify(name, data)
        return data

    async def read_checked(self, name: str, rel_start: int, rel_end: int) -> bytes:
        """Bytes [rel_start, rel_end) of a tensor or blob: one ranged read widened to whole chunks,
        each checked against the header's digest (KnotCorrupt, 503, on a mismatch)."""
        header = await self.header()
        a, b = header.chunk_span(name, rel_start, rel_end)
        base = header.entry_range(name)[0]
        data = await self.read(base + a, base + b)
        self._checked(lambda: header.verify_range(name, a, b, data))
        return data if (a, b) == (rel_start, rel_end) else data[rel_start - a:rel_end - a]

    async def read_rows(self, name: str, row_start: int, row_end: int) -> bytes:
        """Rows [row_start, row_end) of a tensor, checked (read_checked)."""
        header = await self.header()
        start, end = header.row_range(name, row_start, row_end)
        base = header.tensor_range(name)[0]
        return await self.read_checked(name, start - base, end - base)

    def verify(self, name: str, data: bytes | memoryview | None = None, *, crc: int | None = None,
               nbytes: int | None = None) -> None:
        """Check a whole entry's bytes against the header (crc32 and chunk digests), or only their crc32 and
        length (a frame's payload_crc32); KnotCorrupt (503) on a mismatch."""
        header = self._header
        assert header is not None, "verify() before header()"
        if data is not None:
            self._checked(lambda: header.verify(name, data))
        else:
            assert crc is not None and nbytes is not None
            self._checked(lambda: header.verify_crc(name, crc, nbytes))

    def _checked(self, check: Callable[[], None]) -> None:
        try:
            check()
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
                header = await read_header(read_range, file_size=meta.size)
            except KnotError as e:  # shrunk, not a knot, stale: the service cannot run it (503, not 500)
                raise KnotCorrupt(f"knot {self.knot_key!r} version {self.etag!r} cannot be read: {type(e).__name__}: "
                                  f"{e}; re-encode it (`knot encode`) and upload it again") from None
            if self.pin and header.digest != self.pin:
                raise KnotNotPinned(f"knot {self.knot_key!r} in the bucket (version {meta.etag!r}) has digest "
                                    f"{header.digest}; this service is pinned to {self.pin}, so it does not serve "
                                    f"it. {_HOW_TO_REPIN}", digest=header.digest,
                                    headers={KNOT_ETAG_HEADER: meta.etag})
            self._header = header
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

BUCKET_CHECK_TIMEOUT_S = 2.0  # defaults of serving_version's check_timeout_s and check_backoff_s
BUCKET_CHECK_BACKOFF_S = 30.0


@dataclass
class BucketCheck:
    """serving_version's checks of the version the bucket holds (check_bucket): once one failed, none
    is on a request's path for the backoff, and the loaded version is served meanwhile, unverified."""

    failed_at: float | None = None  # time.monotonic() of the last failure; None: the last check passed
    error: str = ""
    failures: int = 0
    skipped: int = 0  # requests served the loaded version without a check: one failed recently, or is running
    running: bool = False

    def due(self, now: float, backoff_s: float) -> bool:
        return not self.running and (self.failed_at is None or now - self.failed_at >= backoff_s)

    def note(self, etag: str) -> str | None:
        """What /readyz says while the bucket's version cannot be checked; None when it can."""
        if self.failed_at is None:
            return None
        return (f"serving the loaded knot version {etag!r} unverified: the bucket's version check failed "
                f"{time.monotonic() - self.failed_at:.0f} s ago ({self.error}); {self.skipped} requests served "
                f"without it")


async def serving_version(cache: BootCache[T], key: str, boot: Callable[[str], Awaitable[T]],
                          source_of: Callable[[T], KnotSource], want: str | None = None,
                          check_bucket: bool = False, check_timeout_s: float = BUCKET_CHECK_TIMEOUT_S,
                          check_backoff_s: float = BUCKET_CHECK_BACKOFF_S, pin: str = "") -> T:
    """The booted value for `key` that serves the knot version `want` (the caller's X-Knot-Etag).

    Reloads (boots again, replacing the cached value; requests in flight keep theirs) when a read
    found the knot replaced, when the caller works on another version than ours and the bucket moved
    on, or, with check_bucket, whenever the bucket holds another version. Raises
    KnotVersionMismatch when the caller's version is not the one the bucket holds.

    check_bucket's check waits check_timeout_s at most; once one failed (the bucket unreachable or
    slow), requests serve the loaded version without one for check_backoff_s (src.bucket_check).
    Why: with S3 stopped, a head() takes the binding's whole timeout (70 s), every request.

    boot(digest) loads the knot only if its digest is that one ("": any). The first boot takes `pin`
    (KNOT_DIGEST); a reload takes `pin`, else the loaded version's digest. A version refused that way
    (KnotNotPinned) leaves the loaded one served; one that reads corrupt (KnotCorrupt) is counted in
    the loaded one's corrupt_reads, which /stats reports and a reload carries over.
    """
    value = await cache.get(key, lambda: boot(pin))
    src = source_of(value)
    needed = src.changed or (want and want != src.etag)  # the bucket's answer decides this request
    if not (needed or check_bucket):
        return value
    check = src.bucket_check
    if not needed and not check.due(time.monotonic(), check_backoff_s):
        check.skipped += 1
        return value
    check.running = True
    try:
        async with asyncio.timeout(None if needed else check_timeout_s):
            current = await src.bucket_etag()
    except (HttpError, TimeoutError) as e:  # the bucket is unreachable: our pinned version is still consistent
        check.failed_at, check.failures = time.monotonic(), check.failures + 1
        check.error = f"{type(e).__name__}: {e}" if str(e) else f"no answer within {check_timeout_s:g} s"
        if needed:
            raise
        log.warning("knot %s: cannot check the bucket's version (%s), serving the loaded %s; the next check in "
                    "%g s", src.knot_key, check.error, src.etag, check_backoff_s)
        return value
    finally:
        check.running = False
    check.failed_at = None
    if current is None:
        src.changed = True
        raise KnotChanged(f"knot {src.knot_key!r} is gone from the bucket (this service loaded version "
                          f"{src.etag!r})", headers={KNOT_ETAG_HEADER: src.etag})
    need = pin or src.digest
    if current != src.etag and src.refused is not None and src.refused[::2] == (current, need):
        src.changed = False  # refused before: serve on what we have (reads of the bucket fail, saying why)
    elif current != src.etag:
        log.warning("knot %s: version %s -> %s in the bucket, reloading", src.knot_key, src.etag, current)
        old = src

        async def reboot() -> T:
            new = await boot(need)
            source_of(new).corrupt_reads += old.corrupt_reads  # a counter (/metrics): it carries over
            return new

        try:
            value = await cache.get(key, reboot, stale=lambda v: source_of(v).etag != current)
        except KnotNotPinned as e:
            src.refused, src.changed = (current, e.digest, need), False
            log.error("knot %s: %s; serving on the loaded version %s", src.knot_key, e, src.etag)
        except KnotCorrupt:
            src.corrupt_reads += 1
            raise
        else:
            src = source_of(value)
    else:
        src.changed, src.refused = False, None  # the same version is back (S3 etags of equal bytes are equal)
    if want and want != src.etag:
        raise KnotVersionMismatch(f"the request works on knot version {want!r} of {src.knot_key!r}; this service "
                                  f"serves {src.etag!r}, the version the bucket holds",
                                  headers={KNOT_ETAG_HEADER: src.etag})
    return value
