"""The station's memory policy (services/station/station_memory.py) against a fake tensor source: the
accounting, most-recently-used eviction, keep-if-it-fits, the cyclic scan it is built for, and the
prefetch of the next phase (room for two, never over the budget, dropped when a forward fails)."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from common.kvcache import largest
from common.matmul import DEFAULT_TILE_BYTES
from common.quant import QTensor
from services.station.station_memory import ForwardWeights, StationMemory, StationMemoryFull

ACT_PER_ROW = 1000  # activation bytes per row, in these tests


def tensor(name: str, nbytes: int, data: np.ndarray | None = None) -> QTensor:
    data = np.zeros(nbytes, np.uint8) if data is None else data
    return QTensor(name, "F32", (nbytes // 4,), data)


class Source:
    """Tensors "t0", "t1", ... of the given sizes; one tensor per phase, phase i of layer 0 reads t{i}."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes, self.loaded = sizes, []

    def names(self, layer: int, phase: str) -> list[str]:
        return [phase]

    def nbytes(self, name: str) -> int:
        return self.sizes[name]

    async def load(self, names: list[str]) -> dict[str, QTensor]:
        self.loaded += names
        return {n: tensor(n, self.sizes[n]) for n in names}


def memory(budget: int, kv: list[int] | None = None) -> StationMemory:
    kv = kv if kv is not None else [0]
    return StationMemory(budget, lambda T, S: ACT_PER_ROW * T + 10 * S, lambda: kv[0])


def fixed(m: StationMemory, T: int, S: int) -> int:
    return m.resident_bytes + m.kv_bytes() + ACT_PER_ROW * T + 10 * S + DEFAULT_TILE_BYTES


async def test_acquire_takes_resident_then_kept_then_loads_the_rest_and_accounts_every_holder():
    kv = [700]
    m = memory(DEFAULT_TILE_BYTES + 100_000, kv)
    m.hold({"norm": tensor("norm", 40)})
    m.kept.put("a", tensor("a", 200), 200)
    src = Source({"norm": 40, "a": 200, "b": 300})
    w = await m.acquire(["norm", "a", "b"], 2, 5, src)
    assert list(w) == ["norm", "a", "b"] and src.loaded == ["b"]
    assert w["norm"] is m.resident["norm"] and w["a"] is m.kept.peek("a")
    assert m.kept.stats.hits == 1
    want = 40 + 200 + 300 + ACT_PER_ROW * 2 + 10 * 5 + 700 + DEFAULT_TILE_BYTES
    assert m.peak_accounted_bytes == want
    kv[0] = 0
    await m.acquire(["a"], 1, 1, src)
    assert m.peak_accounted_bytes == want, "the peak stays"


async def test_at_hand_is_acquire_without_the_work_and_steps_aside_where_acquire_has_some():
    """The resident station's fast path: the same tensors, LRU refresh and peak as acquire() when
    every tensor is resident or kept and nothing must be evicted; None (acquire's turn) otherwise."""
    m = memory(DEFAULT_TILE_BYTES + ACT_PER_ROW + 10 + 1000)
    m.hold({"norm": tensor("norm", 40)})
    for n in "ab":
        m.kept.put(n, tensor(n, 100), 100)
    w = m.at_hand(["norm", "a"], 1, 1)
    assert w == {"norm": m.resident["norm"], "a": m.kept.peek("a")} and list(m.kept.keys()) == ["b", "a"]
    assert m.peak_accounted_bytes == 40 + 200 + ACT_PER_ROW + 10 + DEFAULT_TILE_BYTES
    assert m.held(w) and not m.held({"c": tensor("c", 100)})
    assert m.at_hand(["a", "c"], 1, 1) is None, "c must be loaded"
    assert m.at_hand(["a"], 1, 1 + 80) is None, "80 more positions of activations: room must be made"
    src = Source({"a": 100, "c": 100})
    got = await m.acquire(["a", "c"], 1, 1, src)
    assert src.loaded == ["c"] and not m.held(got), "c counts as loaded until evict_or_keep"
    m.take = lambda kept: None  # a kept tensor whose seal fails: dropped once, then loaded
    assert m.at_hand(["b"], 1, 1) is None and "b" not in m.kept


def test_make_room_evicts_most_recently_used_first_and_never_the_phases_own():
    m = memory(DEFAULT_TILE_BYTES + ACT_PER_ROW + 500)
    for n in "abcd":
        m.kept.put(n, tensor(n, 100), 100)
    m.kept.get("b")  # use order now a, c, d, b
    # 200 new bytes: kept may hold 500 - 10 (activations of S=1) - 200 = 290 of its 400
    m.make_room(200, 1, 1, protect={"b"})
    assert list(m.kept.keys()) == ["a", "b"], "newest first: b is the phase's own, so d then c"


def test_make_room_stops_once_the_phase_fits():
    m = memory(DEFAULT_TILE_BYTES + ACT_PER_ROW + 10 + 400)
    for n in "abcd":
        m.kept.put(n, tensor(n, 100), 100)
    m.make_room(0, 1, 1, protect=set())
    assert list(m.kept.keys()) == ["a", "b", "c", "d"], "everything fits: nothing evicted"
    m.make_room(100, 1, 1, protect=set())
    assert list(m.kept.keys()) == ["a", "b", "c"], "one tensor's room: the newest went"
    m.make_room(0, 1, 41, protect=set())  # 40 more positions of activations, exactly the kept bytes
    assert list(m.kept.keys()) == [], "activations need room too"
    with pytest.raises(StationMemoryFull, match="over the .*-byte budget"):
        m.make_room(0, 301, 1, protect=set())  # 300 more rows than the budget holds: refused, never run over


def test_evict_or_keep_keeps_what_fits_as_copies_and_skips_resident_and_kept():
    m = memory(DEFAULT_TILE_BYTES + ACT_PER_ROW + 10 + 250)
    m.hold({"norm": tensor("norm", 48)})
    m.kept.put("old", tensor("old", 100), 100)
    buf = np.arange(300, dtype=np.uint8)  # one warden batch: the tensors are views of it
    w = {"norm": m.resident["norm"], "old": m.kept.peek("old"),
         "x": tensor("x", 100, buf[:100]), "y": tensor("y", 100, buf[100:200]), "z": tensor("z", 100, buf[200:])}
    m.evict_or_keep(w, 1, 1)
    # room = 250 - 48 (resident) = 202: old (100) + x (100); y and z do not fit
    assert list(m.kept.keys()) == ["old", "x"]
    kept = m.kept.peek("x")
    np.testing.assert_array_equal(kept.data, buf[:100])
    assert not np.shares_memory(kept.data, buf), "a kept view would pin the whole batch buffer"
    assert "norm" not in m.kept


async def test_a_cyclic_scan_streams_only_what_it_cannot_keep():
    """Forwards read t0..t7 in the same order each time, with room for about half of them. Under a
    cyclic scan LRU would evict exactly the tensor needed next and load all 8 every forward;
    evicting the most recently used keeps the budget's worth and loads at most one more than the
    rest (the kept tensor that each miss displaces)."""
    sizes = {f"t{i}": 100 for i in range(8)}
    src = Source(sizes)
    m = memory(DEFAULT_TILE_BYTES + ACT_PER_ROW + 10 + 500)
    weights = ForwardWeights(m, src, 1, 1)
    for forward in range(6):
        src.loaded = []
        for name in sizes:
            w = await weights.load(0, name)
            weights.done(0, name, w)
        assert m.peak_accounted_bytes <= m.budget_bytes
        if forward == 0:
            assert src.loaded == list(sizes)
        else:
            assert len(m.kept) == 5, "the budget's worth stays kept"
            assert 0 < len(src.loaded) <= len(sizes) - len(m.kept) + 1, (forward, src.loaded)


async def test_a_finished_phase_is_copied_only_when_the_next_load_would_not_evict_it_at_once():
    """The same cyclic scan, told the forward's order: a phase that ends is kept (a copy) only if
    it fits beside what loads next; it used to be copied and evicted by the very next make_room,
    a copy per streamed phase (tens of MB each at 7B). The loads stay the same."""
    sizes = {f"t{i}": 100 for i in range(8)}
    order = [(0, n) for n in sizes]
    for told in (False, True):
        src = Source(sizes)
        m = memory(DEFAULT_TILE_BYTES + ACT_PER_ROW + 10 + 500)
        copies = []
        m.keep = lambda t: (copies.append(t.name), t)[1]
        loads = []
        for forward in range(5):
            src.loaded, copies[:] = [], []
            weights = ForwardWeights(m, src, 1, 1, order if told else ())
            for name in sizes:
                w = await weights.load(0, name)
                weights.done(0, name, w)
            assert m.peak_accounted_bytes <= m.budget_bytes
            loads.append(len(src.loaded))
        assert loads == [8, 3, 3, 3, 3], loads
        assert len(copies) == (1 if told else 3), (told, copies)  # each forward's last one, before: every one


async def test_phases_of_different_sizes_keep_nothing_the_large_ones_evict_unused():
    """Small phases then a large one, in a cycle: beside a small phase there is room to keep a
    tensor, which the large phase's make_room then evicts before it is used again (a 7B station
    copied ~250 MB per forward that way). With the plan's set-aside (the largest phase), only what
    every phase leaves room for is kept: the copies stop after the first forward."""
    sizes = {"s0": 100, "s1": 100, "s2": 100, "big": 400}
    order = [(0, n) for n in sizes]
    results = {}
    for set_aside in (0, 400):
        src = Source(sizes)
        m = memory(DEFAULT_TILE_BYTES + ACT_PER_ROW + 10 + 500)
        m.set_aside_bytes = set_aside
        copies = []
        m.keep = lambda t: (copies.append(t.name), t)[1]
        loads, per_forward = [], []
        for forward in range(5):
            src.loaded, copies[:] = [], []
            weights = ForwardWeights(m, src, 1, 1, order)
            for name in sizes:
                w = await weights.load(0, name)
                weights.done(0, name, w)
            assert m.peak_accounted_bytes <= m.budget_bytes
            loads.append(len(src.loaded))
            per_forward.append(len(copies))
        results[set_aside] = (loads, per_forward, m.kept_evictions)
    loads, copies, evictions = results[0]
    assert sum(copies[1:]) == 8 and evictions == 9, results  # kept beside a small phase, evicted by big
    assert results[400] == ([4, 3, 3, 3, 3], [1, 0, 0, 0, 0], 0), results
    # The churn bought a hit every other forward here (loads 2 and 3 against 3): at 7B the warden's
    # bytes went down, not up, since what is kept now stays (docs/performance.md).
    assert loads[1:] == [2, 3, 2, 3], results


class SlowSource(Source):
    """Source whose loads finish only when the test lets them (gate), so a prefetch stays in flight."""

    def __init__(self, sizes: dict[str, int]):
        super().__init__(sizes)
        self.gate = asyncio.Event()
        self.started: list[str] = []

    async def load(self, names: list[str]) -> dict[str, QTensor]:
        self.started += names
        await self.gate.wait()
        return await super().load(names)


def prefetching_memory(budget_room: int, pair_bytes: int) -> StationMemory:
    m = memory(DEFAULT_TILE_BYTES + ACT_PER_ROW + 10 + budget_room)
    m.pair_bytes = pair_bytes
    return m


async def test_prefetch_loads_the_next_phase_while_one_runs_and_counts_both():
    src = SlowSource({f"t{i}": 100 for i in range(4)})
    m = prefetching_memory(200, 200)  # room for two phases, nothing more
    order = [(0, f"t{i}") for i in range(4)]
    async with ForwardWeights(m, src, 1, 1, order, prefetch=True) as weights:
        assert weights.prefetching
        src.gate.set()
        w0 = await weights.load(0, "t0")
        await asyncio.sleep(0)  # the prefetch task starts
        assert src.started == ["t0", "t1"] and m.loaded_bytes == 200, "t1 loads while t0 is held"
        assert m.peak_accounted_bytes <= m.budget_bytes
        weights.done(0, "t0", w0)
        for i in range(1, 4):
            w = await weights.load(0, f"t{i}")
            weights.done(0, f"t{i}", w)
        assert weights.prefetched == 3 and src.loaded == ["t0", "t1", "t2", "t3"]
    assert m.loaded_bytes == 0 and m.loaded == {}
    assert list(m.kept.keys()) == [], "nothing the next forward's first two loads would evict at once"
    assert m.peak_accounted_bytes == m.budget_bytes, "two phases at once, exactly the budget"


async def test_no_prefetch_without_room_for_two_phases():
    src = SlowSource({f"t{i}": 100 for i in range(3)})
    src.gate.set()
    m = prefetching_memory(199, 200)  # one byte short of two phases
    order = [(0, f"t{i}") for i in range(3)]
    async with ForwardWeights(m, src, 1, 1, order, prefetch=True) as weights:
        assert not weights.prefetching
        w = await weights.load(0, "t0")
        await asyncio.sleep(0)
        assert src.started == ["t0"] and m.loaded_bytes == 100
        weights.done(0, "t0", w)
    assert weights.prefetched == 0 and m.peak_accounted_bytes <= m.budget_bytes


async def test_a_forward_that_ends_early_drops_its_prefetch_and_its_bytes():
    src = SlowSource({f"t{i}": 100 for i in range(3)})
    m = prefetching_memory(200, 200)
    order = [(0, f"t{i}") for i in range(3)]
    with pytest.raises(RuntimeError, match="phase failed"):
        async with ForwardWeights(m, src, 1, 1, order, prefetch=True) as weights:
            load = asyncio.ensure_future(weights.load(0, "t0"))
            await asyncio.sleep(0)
            src.gate.set()
            w = await load
            await asyncio.sleep(0)
            assert weights.next is not None and weights.next[0] == (0, "t1")
            weights.done(0, "t0", w)
            raise RuntimeError("phase failed")  # the layer loop's error, with t1 in flight
    assert weights.next is None and m.loaded_bytes == 0 and m.loaded == {}


async def test_prefetch_never_evicts_the_running_phases_kept_tensors():
    src = SlowSource({"a": 100, "b": 100, "c": 100})
    src.gate.set()
    m = prefetching_memory(250, 200)
    m.kept.put("a", tensor("a", 100), 100)
    m.kept.put("c", tensor("c", 100), 100)
    order = [(0, "a"), (0, "b"), (0, "c")]
    async with ForwardWeights(m, src, 1, 1, order, prefetch=True) as weights:
        w = await weights.load(0, "a")  # a kept hit; b needs loading: its prefetch makes room
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert "a" in m.kept and "c" not in m.kept, "the newest kept tensor not in use went, never a"
        weights.done(0, "a", w)
        w = await weights.load(0, "b")
        weights.done(0, "b", w)
        w = await weights.load(0, "c")
        weights.done(0, "c", w)
    assert m.peak_accounted_bytes <= m.budget_bytes and m.loaded_bytes == 0


async def test_compute_runs_off_the_event_loop_only_while_a_prefetch_is_in_flight():
    src = SlowSource({"t0": 100, "t1": 100})
    m = prefetching_memory(200, 200)
    src.gate.set()
    async with ForwardWeights(m, src, 1, 1, [(0, "t0"), (0, "t1")], prefetch=True) as weights:
        w = await weights.load(0, "t0")
        src.gate.clear()  # t1's load waits until the compute below lets it go
        in_thread = await weights.compute(lambda: threading.current_thread() is not threading.main_thread())
        assert in_thread, "the compute ran in a worker thread while t1 loaded"
        src.gate.set()
        weights.done(0, "t0", w)
        w = await weights.load(0, "t1")
        assert not await weights.compute(lambda: threading.current_thread() is not threading.main_thread())
        weights.done(0, "t1", w)
