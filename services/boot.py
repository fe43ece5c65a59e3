"""Module-level boot caches, like a Worker isolate's globals (seed section 1).

Keyed by the configuration that shaped the boot (e.g. knot|role|start-end), so a change of
configuration in the same isolate boots afresh; several services sharing one process
(`knot serve --embedded`) each keep their own entry. Concurrent first requests boot once.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


class BootCache(Generic[T]):
    def __init__(self) -> None:
        self._booted: dict[str, T] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.boots = 0

    async def get(self, key: str, boot: Callable[[], Awaitable[T]]) -> T:
        value = self._booted.get(key)
        if value is not None:
            return value
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            value = self._booted.get(key)
            if value is None:
                value = await boot()
                self._booted[key] = value
                self.boots += 1
        return value

    def clear(self) -> None:
        self._booted.clear()
