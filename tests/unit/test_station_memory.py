"""The station's memory policy (services/station/memory.py) against a fake tensor source: the
accounting, most-recently-used eviction, keep-if-it-fits, and the cyclic scan it is built for."""
from __future__ import annotations

import numpy as np
import pytest

from common.matmul import DEFAULT_TILE_BYTES
from common.quant import QTensor
from services.station.memory import ForwardWeights, StationMemory, StationMemoryFull, largest

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
