"""The L2 tier for embedding rows (seed section 4): dequantized float32 rows in KV, 24 h TTL.

Used by the CobordismWarden: on a RAM miss it asks KV before R2 (the shards reach KV through their
warden, and keep their own small row LRU in front of it). Seed section 8 traps handled here:
- kvGet silent cache poisoning: a value whose length != hidden * 4 is a miss, and the key is
  deleted in the background;
- missing ctx.waitUntil on KV writes: every write and delete goes through wait_until.
A KV that cannot be reached degrades to a miss (logged): the cache must never fail a request.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import numpy as np

from common.runtime import HttpError, KVNamespace

log = logging.getLogger(__name__)

TTL_S = 24 * 3600
KEY_PREFIX = "embed"


def row_key(namespace: str, row: int) -> str:
    """namespace = "{knot_key}@{etag}": a re-uploaded knot never reads the old knot's rows."""
    return f"{KEY_PREFIX}:{namespace}:{row}"


class EmbedRowCache:
    def __init__(self, kv: KVNamespace, namespace: str, hidden: int,
                 wait_until: Callable[[Awaitable[Any]], None], ttl_s: int = TTL_S):
        self.kv, self.namespace, self.hidden = kv, namespace, hidden
        self.wait_until, self.ttl_s = wait_until, ttl_s
        self.row_nbytes = hidden * 4  # float32
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
        """Rows found (and well-formed) in KV: row -> float32 (hidden,)."""
        values = await asyncio.gather(*(self._get(r) for r in rows))
        out: dict[int, np.ndarray] = {}
        for row, value in zip(rows, values):
            if value is None:
                self.misses += 1
            elif len(value) != self.row_nbytes:
                self.misses += 1
                self.poisoned += 1
                key = self.key(row)
                log.warning("KV row %s is %d bytes, expected hidden %d * 4 = %d: poisoned, deleting",
                            key, len(value), self.hidden, self.row_nbytes)
                task = asyncio.ensure_future(self.kv.delete(key))
                self._deleting[key] = task
                self.wait_until(task)
            else:
                self.hits += 1
                out[row] = np.frombuffer(value, dtype="<f4")
        return out

    def put_rows(self, row_start: int, rows_f32: np.ndarray) -> None:
        """Write rows [row_start, row_start + n) in the background (after any pending delete of a key)."""
        assert rows_f32.ndim == 2 and rows_f32.shape[1] == self.hidden, f"{rows_f32.shape=} {self.hidden=}"
        for i, vec in enumerate(np.ascontiguousarray(rows_f32, dtype="<f4")):
            key = self.key(row_start + i)
            self.wait_until(self._write(key, vec.tobytes(), self._deleting.pop(key, None)))

    async def _write(self, key: str, value: bytes, after: asyncio.Future | None) -> None:
        if after is not None:
            await asyncio.wait([after])  # the delete of the poisoned value lands first
        await self.kv.put(key, value, expiration_ttl=self.ttl_s)
        self.writes += 1

    def stats(self) -> dict[str, int]:
        return {"kv_hits": self.hits, "kv_misses": self.misses, "kv_poisoned": self.poisoned,
                "kv_errors": self.errors, "kv_writes": self.writes}
