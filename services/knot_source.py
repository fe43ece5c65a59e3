"""Counted ranged reads of one knot in the bucket (the R2 tier), and its header, read once."""
from __future__ import annotations

from common.knot import KnotHeader, read_header
from common.models import Model, model_for
from common.runtime import Bucket, NotFound, ServiceUnavailable


class KnotSource:
    def __init__(self, bucket: Bucket, knot_key: str):
        self.bucket, self.knot_key = bucket, knot_key
        self.etag = ""
        self.size = 0
        self.reads = 0
        self.bytes_read = 0
        self.header_bytes_read = 0
        self._header: KnotHeader | None = None

    async def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the knot: one HTTP Range request."""
        obj = await self.bucket.get(self.knot_key, range=(start, end))
        if obj is None:
            raise NotFound(f"knot {self.knot_key!r} is not in the bucket (it was there at boot)")
        self.reads += 1
        self.bytes_read += len(obj.body)
        return obj.body

    async def header(self) -> KnotHeader:
        """Parse the header (probe + second fetch if needed) and run the stale-knot size guard."""
        if self._header is None:
            meta = await self.bucket.head(self.knot_key)
            if meta is None:
                raise NotFound(f"knot {self.knot_key!r} is not in the bucket; upload it or fix knot_key")
            self.etag, self.size = meta.etag, meta.size

            async def read_range(start: int, end: int) -> bytes:
                # The reader probes a fixed size; a small knot is shorter than the probe.
                data = await self.read(start, min(end, meta.size))
                self.header_bytes_read += len(data)
                return data

            self._header = await read_header(read_range, file_size=meta.size)
        return self._header

    async def model(self) -> Model:
        """The header's architecture from the model registry; one it lacks (or inconsistent hparams)
        is a 503 that names it: this service cannot run that knot."""
        header = await self.header()
        try:
            return model_for(header)
        except ValueError as e:
            raise ServiceUnavailable(f"knot {self.knot_key!r}: {e}") from None

    def stats(self) -> dict[str, int]:
        return {"r2_reads": self.reads, "r2_bytes_read": self.bytes_read,
                "r2_header_bytes_read": self.header_bytes_read}
