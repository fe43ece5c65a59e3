"""A host process gives the memory its full garbage collections freed back to the system (glibc).

Why: glibc's malloc keeps freed memory for reuse, and raises its thresholds as large blocks come and
go: once a service has freed a block of a size, later blocks up to that size come from its heaps,
whose free tops are returned only past twice that size, and the S3 binding's reads run in a pool of
threads, each with a heap (an arena) of its own. A 0.5B shard reads its 18 MB head slice at every
knot reload, on whichever thread is free, and freed that many bytes each time that its RSS kept:
+17 MiB per reload until every thread's arena held one (benchmarks/reload_rss.py). A reload ends
with a full collection (services/boot.py), and malloc_trim(0) after it hands the freed pages back.
It cannot shrink a thread arena's top, though (glibc trims only the main arena's), and there the
freed read stayed: so the host keeps one arena (M_ARENA_MAX 1), shared by its few threads (the S3
pool, off_loop's), which mostly wait for the GIL or the network rather than for malloc's lock. Not
where MALLOC_MMAP_THRESHOLD_ is set (the stations and the LayerWarden, deploy/compose_writer.py
KEEP_HEAP): those keep freed blocks for reuse on purpose, and their RSS stayed flat over reloads
with their arenas.

Full collections are otherwise rare in these processes (CPython starts one when the objects that
survived into the oldest generation have grown by a quarter), so the trims cost nothing per request.
Only here, in the local host: common/ and services/ run under Pyodide too, which has no libc to ask.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from typing import Callable, Mapping

from common.settings import read

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    """libc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_trim = _malloc_trim()
M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def _trim_after(phase: str, info: dict) -> None:
    """A gc.callbacks entry: malloc_trim(0) once a full collection has freed what it could."""
    if phase == "stop" and info.get("generation") == 2:
        _trim(0)


def trim_after_full_collections(env: Mapping[str, str]) -> bool:
    """From now on, every full collection of this process ends with malloc_trim(0), and, unless env
    keeps the heap (MALLOC_MMAP_THRESHOLD_), threads share one malloc arena (call it before threads
    start). Whether libc has malloc_trim."""
    if _trim is None:
        log.info("this C library has no malloc_trim: freed heap memory stays with the process until reused")
        return False
    if not read(env, "MALLOC_MMAP_THRESHOLD_", "runtime"):
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_ARENA_MAX, 1)
    if _trim_after not in gc.callbacks:
        gc.callbacks.append(_trim_after)
    return True
