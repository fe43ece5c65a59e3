"""ByteLRU: never over budget, least recently used evicted first (or most recently used, for cyclic
scans), resident entries kept."""
from collections import OrderedDict

from hypothesis import given, settings, strategies as st

from common.lru import ByteLRU

BUDGET = 100


def resident(key, nbytes):
    return key.startswith("r")


keys = st.sampled_from(["a", "b", "c", "d", "e", "f", "r1", "r2", "r3"])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), keys, st.integers(0, 60)),
        st.tuples(st.just("get"), keys, st.just(0)),
        st.tuples(st.just("pop"), keys, st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.booleans())
def test_matches_reference_model(seq, newest):
    """A plain reference model of the policy; the LRU must agree on every step."""
    lru = ByteLRU(BUDGET, resident, evict_newest=newest)
    ref: OrderedDict[str, int] = OrderedDict()  # key -> nbytes, oldest first
    for op, key, n in seq:
        if op == "put":
            pinned = sum(v for k, v in ref.items() if resident(k, v) and k != key)
            ref.pop(key, None)
            want_evicted = []
            if pinned + n <= BUDGET:
                for k in list(ref)[::-1] if newest else list(ref):
                    if sum(ref.values()) + n <= BUDGET:
                        break
                    if not resident(k, ref[k]):
                        want_evicted.append(k)
                        del ref[k]
                ref[key] = n
            assert lru.put(key, f"v{key}{n}", n) == want_evicted
        elif op == "get":
            got = lru.get(key)
            if key in ref:
                ref.move_to_end(key)
                assert got is not None
            else:
                assert got is None
        else:
            lru.pop(key)
            ref.pop(key, None)
        assert lru.bytes_used == sum(ref.values()) <= BUDGET
        assert list(lru.keys()) == list(ref)
        assert lru.resident_bytes == sum(v for k, v in ref.items() if resident(k, v))


def test_evicts_least_recently_used_first():
    lru = ByteLRU(30)
    lru.put("a", 1, 10)
    lru.put("b", 2, 10)
    lru.put("c", 3, 10)
    assert lru.get("a") == 1  # a is now the most recent; b is the oldest
    assert lru.put("d", 4, 10) == ["b"]
    assert list(lru.keys()) == ["c", "a", "d"]
    assert (lru.stats.hits, lru.stats.evictions) == (1, 1)


def test_a_cyclic_scan_hits_the_budgets_worth_when_the_newest_is_evicted_first():
    """Eight entries read in the same order again and again, room for five: evicting the oldest
    evicts the one needed next (no hit ever); evicting the newest keeps hitting five per cycle."""
    for newest, want_hits in ((False, 0), (True, 5)):
        lru = ByteLRU(50, evict_newest=newest)
        for cycle in range(4):
            hits = 0
            for i in range(8):
                if lru.get(i) is None:
                    lru.put(i, i, 10)
                else:
                    hits += 1
            if cycle:
                assert hits == want_hits, (newest, cycle, hits)


def test_resident_entries_survive_pressure():
    lru = ByteLRU(30, lambda k, n: "norm" in k)
    lru.put("blk.0.attn_norm.weight", 0, 10)
    for i in range(10):
        lru.put(f"blk.{i}.ffn_up.weight", i, 20)
        assert "blk.0.attn_norm.weight" in lru
        assert lru.bytes_used <= 30


def test_put_that_cannot_fit_is_refused_and_drops_the_old_value():
    lru = ByteLRU(30, lambda k, n: k == "pinned")
    lru.put("pinned", 0, 25)
    lru.put("x", 1, 5)
    assert lru.put("x", 2, 6) == []  # 25 pinned + 6 > 30
    assert "x" not in lru and lru.stats.refused == 1
    assert lru.put("big", 3, 31) == [] and "big" not in lru
