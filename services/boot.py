"""Module-level boot caches, like a Worker isolate's globals (seed section 1).

Keyed by the configuration that shaped the boot (e.g. knot|role|start-end), so a change of
configuration in the same isolate boots afresh; several services sharing one process
(`knot serve --embedded`) each keep their own entry. Concurrent first requests boot once.
A value can go stale (the knot it was booted from was replaced in the bucket): get(stale=...)
boots again and replaces it, once, however many requests noticed (services/knot_source.py).

A replaced value goes with everything it holds (tensors, caches) once the requests that hold it
end: nothing here keeps it. It may still sit in reference cycles (an object and a callback of its
own, an exception's traceback), which only the cyclic collector frees; CPython runs a full
collection rarely in a long-lived process, and a 0.5B station's RSS grew by a version's tensors
per reload (~120 MiB, 1.9x over 10 reloads; benchmarks/reload_rss.py). So after a replacement
the next turn of the event loop runs one full collection: by then the request that reloaded has
let go of the old value, and a value that requests still held is collected at the next reload at
the latest.

`instance` names the process (the isolate) that booted: drawn at its first boot, kept across
reloads, new after a restart. A service's /stats reports it, so the coordinator tells a peer that
came back as another process (restarted) from one that only stopped answering for a while.
"""
from __future__ import annotations

import asyncio
import gc
import uuid
from typing import Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


class BootCache(Generic[T]):
    def __init__(self) -> None:
        self._booted: dict[str, T] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.boots = 0
        self.reloads = 0  # boots that replaced a stale value
        self.instance: str | None = None  # this process's id, drawn at its first boot (no random draw at
        # import: a Cloudflare Worker may draw none outside a request)

    async def get(self, key: str, boot: Callable[[], Awaitable[T]],
                  stale: Callable[[T], bool] | None = None) -> T:
        value = self._booted.get(key)
        if value is not None and not (stale and stale(value)):
            return value
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            value = self._booted.get(key)
            if value is None or (stale and stale(value)):
                replacing = value is not None
                if self.instance is None:
                    self.instance = uuid.uuid4().hex[:12]
                value = await boot()
                self._booted[key] = value
                self.boots += 1
                self.reloads += replacing
                if replacing:  # the old value's last references go as this request moves on (above)
                    asyncio.get_running_loop().call_soon(gc.collect)
        return value

    def peek(self, key: str) -> T | None:
        """The value booted for key, if any (a boot that replaces one may carry some of it over)."""
        return self._booted.get(key)

    def clear(self) -> None:
        """Forget every boot, as a fresh isolate would; its locks too (an asyncio.Lock that was
        waited on belongs to that event loop, and a fresh isolate may run on another)."""
        self._booted.clear()
        self._locks.clear()
