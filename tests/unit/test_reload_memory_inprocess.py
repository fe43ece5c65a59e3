"""Issue 52 item 8, in one process (tests/inprocess.py): a knot reload frees the old version. Every
booted value of the old version (stations, shards, the coordinator) is gone once a request has run
on the new one, with the automatic collector off, so nothing but the reload's own collection
(services/boot.py) and reference counts can free it; and memory (tracemalloc) does not grow with
the number of reloads. tests/integration/test_reload_memory.py checks RSS on real processes."""
from __future__ import annotations

import gc
import tracemalloc
import weakref

import pytest

from services.coordinator import handler as coordinator_handler
from services.shard import handler as shard_handler
from services.station import handler as station_handler
from tests.inprocess import FLUID_BUDGET_BYTES, KNOT_KEY, build_cluster

PROMPT = "the def the"
N = 4
SERVICES = {"station": station_handler, "shard": shard_handler, "coordinator": coordinator_handler}


@pytest.fixture
def no_auto_gc():
    """The cyclic collector runs only when called: what a long-lived process sees between its rare
    full collections, made certain."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def booted() -> dict[str, list]:
    """Every value the services' boot caches hold now, by service."""
    return {name: list(m._booted._booted.values()) for name, m in SERVICES.items()}


def reloads() -> dict[str, int]:
    return {name: m._booted.reloads for name, m in SERVICES.items()}


async def tokens(c) -> list[int]:
    r = await c.generate(prompt=PROMPT, max_tokens=N)
    assert r.status == 200, r.body
    return r.json()["tokens"]


async def reload(c, data: bytes) -> None:
    """The same bytes again under a new version (the bucket's etag changes), then a request on it."""
    await c.bucket.put(KNOT_KEY, data)
    await tokens(c)
    await c.drain()


@pytest.mark.parametrize("budget", [128 << 20, FLUID_BUDGET_BYTES], ids=["resident", "fluid"])
async def test_a_reload_frees_every_booted_value_of_the_old_version(tiny_knot, tmp_path, no_auto_gc, budget):
    c = await build_cluster(tiny_knot, tmp_path, 2, 3, station_budget_bytes=budget)
    data = tiny_knot.read_bytes()
    baseline = await tokens(c)
    old = {name: [weakref.ref(v) for v in values] for name, values in booted().items()}
    assert [len(v) for v in old.values()] == [2, 3, 1]
    before = reloads()

    await reload(c, data)
    assert {n: r - before[n] for n, r in reloads().items()} == {"station": 2, "shard": 3, "coordinator": 1}
    alive = {name: sum(r() is not None for r in refs) for name, refs in old.items()}
    assert alive == {"station": 0, "shard": 0, "coordinator": 0}, (
        f"old version's values still alive after a reload: {alive}; referrers of one: "
        f"{[type(x).__name__ for refs in old.values() for r in refs if r() is not None for x in gc.get_referrers(r())]}")
    assert await tokens(c) == baseline


async def test_a_value_held_through_a_reload_goes_at_the_next_one(tiny_knot, tmp_path, no_auto_gc):
    """A request still running on the old version when the reload happens keeps it; once it ends,
    the old value goes at the next reload at the latest, even if only cycles hold it then."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 2)
    data = tiny_knot.read_bytes()
    await tokens(c)
    held = booted()["station"][0]  # what a request in flight holds
    ref = weakref.ref(held)
    await reload(c, data)
    assert ref() is held  # still in use: kept
    del held
    await reload(c, data)
    assert ref() is None


async def test_a_reload_keeps_a_tokenizer_of_the_same_bytes(tiny_knot, tmp_path):
    """The coordinator's tokenizer is built once per distinct tokenizer blob, not once per reload."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 2)
    await tokens(c)
    (before,) = booted()["coordinator"]
    await reload(c, tiny_knot.read_bytes())
    (after,) = booted()["coordinator"]
    assert after.co is not before.co and after.source.etag != before.source.etag
    assert after.co.tokenizer is before.co.tokenizer


async def test_memory_does_not_grow_with_reloads(tiny_knot, tmp_path, no_auto_gc):
    """tracemalloc (numpy's buffers included) after 6 reloads against after 1: less than one version's
    tensors more, where every reload used to keep another version's."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 3)
    data = tiny_knot.read_bytes()
    await tokens(c)
    tracemalloc.start()
    try:
        await reload(c, data)
        after_one = tracemalloc.get_traced_memory()[0]
        for _ in range(5):
            await reload(c, data)
        after_six = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after_six - after_one < len(data) // 2, (after_one, after_six, len(data))


def test_the_local_host_trims_the_heap_after_each_full_collection(monkeypatch):
    """deploy/local/malloc_trim.py: a full collection (a reload's) ends with malloc_trim(0), which hands the
    pages it freed back to the system; a young-generation collection does not."""
    from deploy.local import malloc_trim

    calls = []
    monkeypatch.setattr(malloc_trim, "_trim", calls.append)
    saved = list(gc.callbacks)  # the interpreter's own list: changed in place, restored after
    gc.callbacks.clear()
    try:
        assert malloc_trim.trim_after_full_collections({})
        assert malloc_trim.trim_after_full_collections({})
        assert gc.callbacks == [malloc_trim._trim_after], "installed once"
        gc.collect(0)
        assert calls == []
        gc.collect()
        assert calls == [0]
    finally:
        gc.callbacks[:] = saved
    assert malloc_trim._malloc_trim() is not None, "glibc has malloc_trim: the hosts of this machine trim"
