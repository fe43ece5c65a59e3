"""Byte-budget LRU with a residency predicate.

Invariant: bytes_used <= budget_bytes after every call. Resident entries (is_resident(key,
nbytes) true) count toward the budget but are never evicted; a put that cannot fit even after
evicting every non-resident entry is refused (an older value under that key is dropped).

evict_newest=True evicts the most recently used first instead: the right order for a cache read
in the same cyclic order every time (a LayerWarden serving its station's layers, forward after
forward), where evicting the oldest evicts exactly the entry needed next and a budget one entry
short of the cycle hits nothing (Belady: evict what is needed furthest ahead, the one just used).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Iterator, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def never_resident(key: Hashable, nbytes: int) -> bool:
    return False


@dataclass
class LRUStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0  # puts that could not fit


class ByteLRU(Generic[K, V]):
    def __init__(self, budget_bytes: int, is_resident: Callable[[K, int], bool] = never_resident,
                 evict_newest: bool = False):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.is_resident = is_resident
        self.evict_newest = evict_newest
        self._entries: OrderedDict[K, tuple[V, int, bool]] = OrderedDict()  # oldest first
        self.bytes_used = 0
        self.resident_bytes = 0
        self.stats = LRUStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def keys(self) -> Iterator[K]:
        """Least recently used first."""
        return iter(list(self._entries))

    def get(self, key: K) -> V | None:
        """The value (now most recently used), or None; counts a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry[0]

    def peek(self, key: K) -> V | None:
        """The value without touching recency or stats."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: K, value: V, nbytes: int) -> list[K]:
        """Insert or replace; returns the keys evicted to make room ([] when refused or none)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        resident = bool(self.is_resident(key, nbytes))
        old = self._entries.get(key)
        # Bytes nothing can evict: the resident entries other than the one being replaced.
        pinned_bytes = self.resident_bytes - (old[1] if old and old[2] else 0)
        if pinned_bytes + nbytes > self.budget_bytes:
            self.stats.refused += 1
            if old:  # never keep serving a value the caller has replaced
                self._remove(key)
            return []
        if old:
            self._remove(key)
        evicted: list[K] = []
        if self.bytes_used + nbytes > self.budget_bytes:
            order = list(self._entries)  # oldest first
            for k in reversed(order) if self.evict_newest else order:
                if self._entries[k][2]:
                    continue
                self._remove(k)
                evicted.append(k)
                self.stats.evictions += 1
                if self.bytes_used + nbytes <= self.budget_bytes:
                    break
        self._entries[key] = (value, nbytes, resident)
        self.bytes_used += nbytes
        if resident:
            self.resident_bytes += nbytes
        assert self.bytes_used <= self.budget_bytes, f"{self.bytes_used=} {self.budget_bytes=}"
        return evicted

    def pop(self, key: K) -> V | None:
        """Drop one entry (resident or not); returns its value or None."""
        if key not in self._entries:
            return None
        value = self._entries[key][0]
        self._remove(key)
        return value

    def clear(self) -> None:
        self._entries.clear()
        self.bytes_used = 0
        self.resident_bytes = 0

    def _remove(self, key: K) -> None:
        _, nbytes, resident = self._entries.pop(key)
        self.bytes_used -= nbytes
        if resident:
            self.resident_bytes -= nbytes
